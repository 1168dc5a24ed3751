"""Randomness keyed by (seed, stream, step, sample index): stateless, so it survives a resume,
and per sample, so it is the same at any world size.

A per-rank RNG (torch's global generator, a ``torch.Generator`` the task keeps) breaks both:
the sample that rank 1 drew a mask for at world size 2 is rank 0's at world size 1, and a
generator's position is state the checkpoint must hold. Counter-based keys need neither.

The draws are a counter-based hash, computed with integer tensor ops: SplitMix64's finalizer
(Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014) keys
each sample from its seed and the site, and a 32-bit integer hash (Wellons' lowbias32) mixes
that key XOR the element's index in the sample. One batch of elementwise kernels per site,
no Python loop over the samples and no data-dependent branch, so
``torch.compile(fullgraph=True)`` traces it (and inductor fuses it into one kernel); a
sample's draws depend on its key alone, never on its batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
UNIFORM_BITS = 24
"""Bits of each draw that make a uniform number: exact in float32 (a 2**-24 grid)."""


def splitmix64(x: int) -> int:
    """One splitmix64 step on a Python int: spreads a key over all 64 bits."""
    z = (x + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def keyed_seed(keys: Iterable[int]) -> int:
    """A 63-bit seed that is a pure function of ``keys`` (order matters)."""
    return _chain(keys) & _MASK63


def keyed_seeds(keys: Sequence[int], counters: Sequence[int]) -> list[int]:
    """``keyed_seed((*keys, counter))`` for each counter."""
    return [keyed_seed((*keys, int(c))) for c in counters]


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it (torch's int64 arithmetic wraps)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (``>>`` on int64 is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors, bit for bit the Python one's."""
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)
    return z ^ _shift_right(z, 31)


def keyed_seed_tensor(prefix: int, counters: torch.Tensor) -> torch.Tensor:
    """``keyed_seed((*keys, c))`` for each int64 ``c`` in ``counters``, where ``prefix`` is
    the chain's hash of ``keys`` (``_chain(keys)``): vectorized, bit for bit the same."""
    z = (counters ^ _signed(prefix)) + _signed(_GAMMA)
    return _mix(z) & _MASK63


def _chain(keys: Iterable[int]) -> int:
    """The unmasked hash of ``keys``, which ``keyed_seed`` masks to 63 bits."""
    h = 0
    for key in keys:
        h = splitmix64(h ^ (key & _MASK64))
    return h


def sample_seed_tensor(keys: Sequence[int], counters: torch.Tensor) -> torch.Tensor:
    """``keyed_seeds(keys, counters)`` as an int64 tensor, in one pass of tensor ops."""
    return keyed_seed_tensor(_chain(keys), counters.to(torch.int64))


def _as_seeds(seeds: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(seeds, torch.Tensor):
        return seeds.to(device=device, dtype=torch.int64)
    return torch.tensor([int(s) for s in seeds], dtype=torch.int64, device=device)


_HASH1 = 0x7FEB352D
_HASH2 = 0x846CA68B - (1 << 32)  # as the int32 that holds its bits
"""The multipliers of Wellons' lowbias32 (hash-prospector), a 32-bit integer hash."""
MAX_ELEMENTS = 1 << 31
"""Elements per sample a site can key: the element's index is 31 bits of the hash's input."""


def _shift_right32(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 bit patterns."""
    return (z >> bits) & ((1 << (32 - bits)) - 1)


def _site_hash(site: int, device: torch.device) -> int | torch.Tensor:
    """``splitmix64(site)`` as an int64. Under ``torch.compile`` with tensor ops, bit for bit
    the same: the site may be a symbolic int there (dynamo makes a block's index one when the
    blocks are compiled one by one, ``--compile`` under fsdp2), and Python arithmetic on it
    with 64-bit constants becomes an index expression that inductor cannot print in C++ (an
    OverflowError, torch 2.13)."""
    if not torch.compiler.is_compiling():
        return _signed(splitmix64(site & _MASK64))
    return _mix(torch.scalar_tensor(site, dtype=torch.int64, device=device) + _signed(_GAMMA))


def keyed_bits(
    seeds: Sequence[int] | torch.Tensor, site: int, shape: Sequence[int], device: torch.device
) -> torch.Tensor:
    """32 random bits (int32) per element of ``(len(seeds), *shape)``: element j of sample b
    hashes (key(seeds[b], site) ^ j), where the key is SplitMix64's mix of the two."""
    seeds = _as_seeds(seeds, device)
    count = 1
    for size in shape:
        count *= int(size)
    if count > MAX_ELEMENTS:
        raise ValueError(f"{count} elements per sample: at most {MAX_ELEMENTS} can be keyed")
    # Each sample's key: (seed ^ hash(site)) mixed, its low 32 bits as an int32.
    stream = _mix((seeds ^ _site_hash(site, device)) + _signed(_GAMMA))
    key = (((stream & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000).to(torch.int32)
    # 32-bit arithmetic: int64 multiplies have no vector instruction on most CPUs, int32 ones
    # do. The element's index is XORed in, not multiplied: inductor's index arithmetic
    # overflows on an arange times a large constant (a crash of the CPU kernel it generates,
    # torch 2.13). The key's bits are random already and the index varies the low ones, which
    # the multiplies carry upwards: lowbias32 without its first and last xorshift, which only
    # bring high bits down, and the draws use the high bits.
    counter = torch.arange(count, dtype=torch.int32, device=device).view(1, *shape)
    z = (key.view(-1, *[1] * len(shape)) ^ counter) * _HASH1
    return (z ^ _shift_right32(z, 15)) * _HASH2


def keyed_uniform(
    seeds: Sequence[int] | torch.Tensor,
    site: int,
    shape: Sequence[int],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Uniform numbers in [0, 1) of shape ``(len(seeds), *shape)``, on a 2**-24 grid; sample
    b's depend on ``seeds[b]`` and ``site`` alone. For augmentation, masks, noise."""
    top = _shift_right32(keyed_bits(seeds, site, shape, device), 32 - UNIFORM_BITS)
    return top.to(dtype) * (2.0**-UNIFORM_BITS)


def keyed_dropout(
    x: torch.Tensor, p: float, seeds: Sequence[int] | torch.Tensor, site: int
) -> torch.Tensor:
    """Dropout over ``x`` (samples first) whose mask for sample b is drawn from
    ``seeds[b]`` and ``site`` alone (one site per dropout layer): whatever the batch it is in.
    ``seeds`` is ``where.sample_seeds(stream)`` (an int64 tensor) or a list of ints.

    Call it only in training; in ``eval()`` return ``x``, as ``nn.Dropout`` does.
    """
    if p <= 0.0:
        return x
    if len(seeds) != x.shape[0]:
        raise ValueError(f"one seed per sample: {len(seeds)} seeds for {x.shape[0]} samples")
    # The 32 bits as a signed integer are uniform over [-2**31, 2**31): keep an element with
    # probability 1 - p (to 2**-32) by one comparison on that grid, no float and no shift.
    bits = keyed_bits(seeds, site, x.shape[1:], x.device)
    keep = bits >= min(round(p * 2.0**32), 2**32 - 1) - 2**31
    return x * keep / (1.0 - p)  # a bool factor: cheaper than where() with a scalar
