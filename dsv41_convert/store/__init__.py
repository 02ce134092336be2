"""Storage: safetensors headers, the hashing writer of output files, resume journals and manifests.

Knows byte ranges, digests and file states, not what a tensor means. May import `config`, `errors` and
`progress` only.
"""
