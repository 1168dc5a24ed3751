"""How a worker's state is saved: periodically in the background (``periodic.py``), before it
exits (``emergency.py``), and each rank its own shards when the model is sharded
(``sharded.py``)."""
