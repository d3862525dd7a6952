"""The n-gram hash of Qwen4-Exp's per-layer embedding (PLE), as transformers' Qwen4ExpTextNGramEmbedding defines it:
pure integer arithmetic, no torch (config reading sizes the tables from it).

Each PLE layer has (ngram_size - 1) * heads_per_ngram heads. Head i of the model (counting the PLE layers' heads end
to end) has a vocabulary of the (i+1)-th prime >= ngram_vocab_size_base; a layer's table stacks its heads'
vocabularies (each head's rows start at the sum of the earlier ones) and pads the total to a multiple of
make_ngram_vocab_size_divisible_by. A layer's hash multipliers (one odd 63-bit multiplier per n-gram position) come
from splitmix64 of its seed.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_PRIME_1 = 10007
# Miller-Rabin with these bases is exact for every n < 3.3e24 (far past any vocabulary INT_BOUNDS allows)
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
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


def head_vocab_sizes(base: int, layers: int, heads: int) -> list[tuple[int, ...]]:
    """Per PLE layer, its heads' vocabulary sizes: the primes >= `base` in order, `heads` per layer."""
    primes: list[int] = []
    candidate = base
    while len(primes) < layers * heads:
        if is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return [tuple(primes[j * heads:(j + 1) * heads]) for j in range(layers)]


def padded_rows(sizes: tuple[int, ...], divisible_by: int) -> int:
    """A layer's table rows: its heads' vocabularies end to end, padded to a multiple of `divisible_by`."""
    return -(-sum(sizes) // divisible_by) * divisible_by


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The hash multipliers of the `ple_index`-th PLE layer, one per n-gram position (odd, so that token id times
    multiplier never overflows int64 for ids below vocab_size)."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base_seed = seed + _PRIME_1 * ple_index
    return [2 * (_splitmix64((base_seed + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)]
