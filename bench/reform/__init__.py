"""``python -m bench.reform``: the re-form after a peer's loss on nodes with two processes each,
their checkpoints on Azurite (issue 36: torch closing a node's workers is not an eviction)."""
