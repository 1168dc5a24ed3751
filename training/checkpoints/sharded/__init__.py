"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) on the project's object stores.

Every rank writes its own part of the state (``writer.py``), the coordinator commits the
checkpoint through the commit protocol of ``training/checkpoints/checkpoint.py`` once every
rank's file and the DCP metadata are in the store, and readers verify each file they need
before any tensor is touched (``reader.py``), falling back to the previous checkpoint
(``repository.py``). ``metadata.py`` reads DCP's metadata as data, never code; ``state.py``
is what a checkpoint holds: the model and optimizer through
``torch.distributed.checkpoint.state_dict``, and the trainer's own state as a ``Stateful``.
``initial.py`` reads another run's model into a sharded one (``--init-from``), each rank
only its shards.
"""
