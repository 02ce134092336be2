"""Engram's bucket counts: the successive primes above `engram_vocab_size - 1`, one per (layer, n-gram size,
head), and the table rows they add up to (no torch: config checks engram_num_embeddings against them)."""

from __future__ import annotations

from collections.abc import Iterator

# the bits of the published engram_vocab_size (16,000,000): the size at which ENGRAM_PRIMES_SEARCHED was timed
SEARCH_BITS = 24

# bases that make Miller-Rabin deterministic for every n < 3.3e24 (far above any bucket count)
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic primality test for the bucket counts (exact below 3.3e24)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def primes_above(start: int) -> Iterator[int]:
    """The primes greater than `start`, in increasing order."""
    n = start + 1
    while True:
        if is_prime(n):
            yield n
        n += 1


def bucket_primes(
    n_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """primes[g][n - 2][head]: the bucket count of n-gram size n and `head` in Engram layer g.

    One shared increasing sequence of primes above vocab_size - 1, handed out layer by layer, so a
    prime is never reused by a later (layer, n-gram) row.
    """
    supply = primes_above(vocab_size - 1)
    return tuple(
        tuple(tuple(next(supply) for _ in range(n_heads)) for _ in range(max_ngram_size - 1)) for _ in range(n_layers)
    )


def engram_table_rows(n_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> tuple[int, ...]:
    """Rows of each Engram layer's table (config engram_num_embeddings): the sum of its primes."""
    return tuple(
        sum(p for row in layer for p in row) for layer in bucket_primes(n_layers, max_ngram_size, n_heads, vocab_size)
    )


def engram_least_rows(max_ngram_size: int, n_heads: int, vocab_size: int) -> int:
    """A lower bound of every layer's table rows, found without a prime: the sum of its (max_ngram_size - 1) x
    n_heads distinct bucket primes, each at least vocab_size, is at least that many consecutive ints from there."""
    count = max(max_ngram_size - 1, 0) * n_heads
    return count * vocab_size + count * (count - 1) // 2


def engram_primes_searchable(most: int, vocab_size: int) -> int:
    """How many bucket primes above `vocab_size` are found in the time `most` primes of SEARCH_BITS bits take.

    Each prime is dearer the larger it is (about as the cube of its bits: more numbers tested between primes,
    each test on longer ints; 10,000 primes above 2**62 took 2.4 s, as long as 90,000 above 16,000,000).
    """
    bits = max(vocab_size.bit_length(), SEARCH_BITS)
    return most * SEARCH_BITS**3 // bits**3
