"""``python -m bench.sharded_memory``: each rank's peak memory while it saves and restores a
sharded (DCP) checkpoint, against its share of the state (issue 33)."""
