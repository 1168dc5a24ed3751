"""``python -m bench sharded-state``: an FSDP2 run's state path at GB scale (issue 33): each
rank's part saved alone on an eviction, the resharded restore to the first step at the smaller
world, a kill-all restored at another world size, each rank's peak RSS; today's DDP
single-file path beside it; the step time with periodic sharded saves against none."""
