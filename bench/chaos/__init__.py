"""``python -m bench chaos``: random schedules of overlapping faults, each checked against the
invariants the job promises (``invariants.py``)."""
