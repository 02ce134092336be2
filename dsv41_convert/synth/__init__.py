"""Synthetic checkpoints: a Hugging Face-format DeepSeek V4.1 checkpoint with random weights, laid
out like the published one (same names, file dtypes, shard grouping, config keys, tokenizer files).

presets.py    frozen size records (`tiny`, `medium`) -> nested HF config.json
tokenizer.py  a small byte-level BPE tokenizer.json and its compressed token map
tensors.py    the name / dtype / shape catalogue of a ModelArgs
weights.py    seeded random values of a catalogue Param, in either source layout
quantized.py  fp8 / fp4 weights drawn as codes and scales already in canonical form
write.py      shard plan and the streaming writer

May import `convert.catalogue`, `model.engram_hash`, `quant`, `config`, `errors`, `progress`.
"""
