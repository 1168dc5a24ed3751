"""``python -m bench.data_copy``: the workers' dataset copy (``training/data/fetch_data.py``) at
GB scale: its peak RSS against the bytes it copies, and a copy killed halfway and restarted."""
