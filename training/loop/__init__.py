"""A worker's training: its config, model and distributed env, the Trainer (its state and saves
in ``trainer_state``, the loop in ``trainer``), the periodic and emergency saves, the step guard,
the inputs checked before the first collective, and the log lines. May import
``training.elastic``, ``training.checkpoints`` and ``training.data``."""
