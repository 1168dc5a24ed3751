"""``python -m bench input-pipeline``: the training step with loader threads against fetching
in the training thread, on a dataset slow to read, side by side."""
