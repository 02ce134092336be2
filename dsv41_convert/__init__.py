"""dsv41-convert: checkpoint conversion, quantization and verification for DeepSeek V4.1."""

__version__ = "0.1.0"
