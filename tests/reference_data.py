"""Where the tests find the published checkpoint's metadata (config, catalog, index, headers).

A copy lives in tests/data/reference (from the steering repo's shared/reference; see README.md
there for provenance), so a clean clone tests against the real 96,085-tensor layout.
"""

from pathlib import Path

REFERENCE = Path(__file__).resolve().parent / "data" / "reference"
REAL_CONFIG = REFERENCE / "v41-flash.config.json"
CATALOG = REFERENCE / "v41-flash.tensor-catalog.json"
INDEX_GZ = REFERENCE / "v41-flash.model.safetensors.index.RECONSTRUCTED.json.gz"
HEADERS_GZ = REFERENCE / "v41-flash.headers.RECONSTRUCTED.json.gz"
TOKENIZER_CONFIG = REFERENCE / "v41-flash.tokenizer_config.json"
