"""Benchmarks: the lab against plain ``torchrun`` defaults plus a periodic checkpoint."""
