"""Storage: safetensors headers, the hashing writer of output files, resume journals, manifests, the
one-writer-per-folder locks and the shard names an index may give.

Knows byte ranges, digests and file states, not what a tensor means. May import `config`, `errors` and
`progress` only.
"""
