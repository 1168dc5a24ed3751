"""``python -m bench keyed-random``: charlm's step time with dropout, its keyed randomness
drawn per sample with a generator each (before) and vectorized (after), side by side."""
