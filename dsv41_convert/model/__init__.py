"""The DeepSeek V4.1 model, split by component (upstream keeps it in one model.py).

Class and attribute names are upstream's: they are the state-dict contract of the shards.

May import `config`, `errors`, `kernels` (through kernels/dispatch.py) and `store.safetensors_header`
(to read rank files); never the converter, verify or the CLI.
"""

from dsv41_convert.model.load import load_shards
from dsv41_convert.model.transformer import Transformer

__all__ = ["Transformer", "load_shards"]
