"""Randomness keyed by (seed, stream, step, sample index): stateless, so it survives a resume,
and per sample, so it is the same at any world size.

A per-rank RNG (torch's global generator, a ``torch.Generator`` the task keeps) breaks both:
the sample that rank 1 drew a mask for at world size 2 is rank 0's at world size 1, and a
generator's position is state the checkpoint must hold. Counter-based keys need neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def splitmix64(x: int) -> int:
    """One splitmix64 step on a Python int: spreads a key over all 64 bits."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def keyed_seed(keys: Iterable[int]) -> int:
    """A 63-bit seed that is a pure function of ``keys`` (order matters)."""
    h = 0
    for key in keys:
        h = splitmix64(h ^ (key & _MASK64))
    return h & _MASK63


def keyed_seeds(keys: Sequence[int], counters: Sequence[int]) -> list[int]:
    """``keyed_seed((*keys, counter))`` for each counter."""
    return [keyed_seed((*keys, int(c))) for c in counters]


def keyed_dropout(x: torch.Tensor, p: float, seeds: Sequence[int], site: int) -> torch.Tensor:
    """Dropout over ``x`` (samples first) whose mask for sample b is drawn from
    ``seeds[b]`` and ``site`` alone (one site per dropout layer): whatever the batch it is in.

    Call it only in training; in ``eval()`` return ``x``, as ``nn.Dropout`` does.
    """
    if p <= 0.0:
        return x
    if len(seeds) != x.shape[0]:
        raise ValueError(f"one seed per sample: {len(seeds)} seeds for {x.shape[0]} samples")
    masks = []
    for seed in seeds:
        generator = torch.Generator(device=x.device)
        generator.manual_seed(keyed_seed((seed, site)))
        masks.append(torch.rand(x.shape[1:], generator=generator, device=x.device) >= p)
    return x * torch.stack(masks).to(x.dtype) / (1.0 - p)
