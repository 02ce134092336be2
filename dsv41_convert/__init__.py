"""dsv41-convert: checkpoint conversion, quantization and verification for DeepSeek V4.1.

The package, bottom to top (imports point downward only):
    errors.py, config.py, progress.py   what every layer shares: error types, ModelArgs, the progress callback
    expert_names.py   the routed-expert tensor name pattern (convert's rules and model's loader read it)
    engram_buckets.py   Engram's bucket primes and the table rows they give (no torch: config checks with them)
    engram_tokens.py   Engram's compressed token map of a tokenizer (no torch: plan checks a source's with it)
    interrupts.py   Ctrl-C and SIGTERM postponed while a file's writer threads run
    torchrun.py     the enclosing torchrun launch, from its environment
    quant/     number formats (pure torch)
    kernels/   TileLang kernels beside their torch references
    store/     safetensors headers, the hashing writer, journals, manifests, folder locks
    model/     the bundled V4.1 model
    convert/   rules, plan, validate, execute: the converter
    published.py   the published V4.1-Flash config, against which a config of its tensors is compared
    hub/       the Hugging Face Hub client
    verify/    the logit check
    synth/     make-tiny checkpoints
    app/, cli.py, console.py   the command line (console.py: the console script, which loads cli.py)
"""

__version__ = "0.1.0"
