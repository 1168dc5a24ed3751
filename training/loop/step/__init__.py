"""The optimiser step's math, which the loop owns: the loss's normalization over the global
batch (``losses.py``) and the precision it is computed in (``precision.py``)."""
