"""``python -m bench keyed-random``: charlm's step time with dropout off and with its keyed
masks, side by side."""
