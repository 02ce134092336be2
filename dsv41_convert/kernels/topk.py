"""The index counts the sparse_attn kernel is compiled for, without importing TileLang.

Its wrapper pads each query's index list with -1 up to a bucket (so one kernel serves many sequence
lengths), and the model's warm-up compiles every bucket a run can reach before collectives start.
"""

BLOCK = 64  # indices per online-softmax step of the kernel (as the reference)


def topk_bucket(topk: int) -> int:
    """The padded index count the kernel is compiled for: 64 * the next power of two of ceil(topk / 64)."""
    blocks = -(-topk // BLOCK)
    return BLOCK * (1 << (blocks - 1).bit_length())


def topk_buckets(most: int) -> list[int]:
    """Every bucket that an index count of 1..most pads to, ascending."""
    return sorted({topk_bucket(t) for t in range(1, most + 1)})
