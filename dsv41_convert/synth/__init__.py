"""Synthetic checkpoints: a Hugging Face-format DeepSeek V4.1 checkpoint with random weights, laid
out like the published one (same names, file dtypes, shard grouping, config keys, tokenizer files).

presets.py    frozen size records (`tiny`, `medium`) -> nested HF config.json
engram.py     Engram table rows (prime bucket ranges) for a config
tokenizer.py  a small byte-level BPE tokenizer.json and its compressed token map
tensors.py    the name / dtype / shape catalogue of a ModelArgs
weights.py    seeded random values, quantized through dsv41_convert.quant
write.py      shard plan and the streaming writer
"""
