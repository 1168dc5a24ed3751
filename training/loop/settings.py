"""The training loop's own settings: the sections of its flags, their defaults and their help,
torch-free. The trainer's flag module (``training/loop/config.py``) parses them; the stack's
config checks ``trainArgs`` against them without importing the parser."""

from __future__ import annotations

from dataclasses import dataclass

from training.tasks import DEFAULT_TASK


@dataclass
class DataConfig:
    data_dir: str = ""
    """The directory the task reads its data from (its load_data; on the cluster, the copy of
    the data container, TRAIN_DATA_DIR). Required."""
    loader_workers: int = 2
    """Threads that read indexable samples ahead of the step (0: read in the training thread).
    A stream is always read by one thread of its own."""
    prefetch_steps: int = 2
    """Steps of this rank's items read ahead of the step in flight."""


@dataclass
class OptimConfig:
    lr: float = 0.05
    """Learning rate (the peak of the task's schedule, if it has one)."""
    global_batch_size: int = 256
    """Samples per optimiser step, whatever the world size."""
    micro_batch_size: int = 64
    """Largest forward chunk per rank; bigger shares use gradient accumulation."""


@dataclass
class CheckpointConfig:
    checkpoint_uri: str = ""
    """Durable checkpoints: a local directory or an https:// Blob URL (not a FUSE mount)."""
    local_dir: str = "/tmp/spot-lab-local"
    """Node-local directory for emergency saves, picked up by the survivors' next round."""
    checkpoint_every_steps: int = 100
    """Durable save every K steps (0 = off)."""
    checkpoint_every_seconds: float = 0.0
    """Durable save every T seconds (0 = off)."""
    checkpoint_keep: int = 3
    """Durable checkpoints kept; older ones are deleted once a newer one is committed."""
    emergency_saves: bool = True
    """Save the last completed step on SIGTERM or a peer's loss (off: periodic saves only)."""
    restore_timeout_s: int = 600
    """Timeout of the checkpoint group: ranks wait this long for one that reads or writes
    storage (restore, final save). The short ``--collective-timeout-s`` would turn a slow
    Blob store into timeouts and restart loops."""
    records_uri: str = ""
    """Where each process also stores its metrics and events, a small object per 30 s, so a
    run's history outlives its pods (lab report --stack): a directory or an https:// Blob URL;
    "" = beside Blob checkpoints (<checkpoint-uri>/records), nowhere for a directory's; off."""
    init_from: str = ""
    """Another run's --checkpoint-uri to start from: the model's weights of its newest
    verified checkpoint, with a fresh optimizer at step 0 (only while this run has no state
    of its own; "" = a fresh model)."""
    stop_deadline_s: float = 25.0
    """Seconds from SIGTERM by which the emergency save, node-local then durable, is done or
    given up (the node-local copy stays; the worker exits 138): fits the pod's 30 s
    termination grace, a spot eviction's notice, with time left to exit. At most the grace."""


@dataclass
class RunConfig:
    task: str = DEFAULT_TASK
    """What to train: a task of training/tasks/ by name, or a TrainSpec of your own module as
    module.path:attribute (docs/your-own-model.md)."""
    eval_every: int = 0
    """Steps between the task's evaluations (0 = none; a task without one ignores it)."""
    max_steps: int = 1000
    """Optimiser steps to train for."""
    max_steps_file: str = ""
    """A file holding a step count that raises max_steps while training runs (read every
    step; never lowers it): the local lab extends a run whose faults fell behind."""
    seed: int = 0
    """Seeds the model init, the sample order and the augmentation."""
    log_every: int = 10
    """Steps between metrics lines."""
    collective_timeout_s: int = 30
    """Process-group timeout: a frozen peer ends in a restart after this, not a 30 min hang."""
    min_step_time_s: float = 0.0
    """Pacing (0 = off): each step takes at least this long, so that a lab scenario's steps
    mean the same wall-clock time on a fast machine as on a slow one."""
    dtype: str = "float32"
    """Parameters and compute: float32, or float64 (on CPU: runs at different world sizes
    then agree to about 1e-15, the sharp test of exact resume)."""
    precision: str = "fp32"
    """fp32, bf16-mixed or fp16-mixed: the forward and the loss under torch.autocast in bf16
    or fp16 (fp16 with a gradient scaler); parameters, optimizer state and checkpoints stay
    float32. Part of the run's identity (docs/your-own-model.md)."""
    parallelism: str = "ddp"
    """How the model is spread over the ranks: ddp (a whole copy on every rank, gradients
    all-reduced) or fsdp2 (parameters, gradients and optimizer state sharded with
    fully_shard, built on the meta device: for a model one rank cannot hold; the task must
    define parallelize and init_weights). Not part of the run's identity."""
    resume_check: bool = True
    """Before training, run one micro-batch forward and backward twice: from the state in
    memory, and after putting back what a restore would besides the parameters and the
    optimizer's moments; stop with an error naming what differs (state the task keeps
    outside the checkpoint: docs/your-own-model.md). Costs two passes per round, no copy
    of anything that grows with the model."""
    compile: bool = False
    """torch.compile the model (inductor), in place: under ddp the module DDP then wraps,
    under fsdp2 each unit the task sharded (each transformer block). Compile time at each
    round's first steps, for faster steps after."""
    deterministic: bool = False
    """Deterministic kernels: torch.use_deterministic_algorithms, cuDNN deterministic with
    benchmarking and TF32 off, CUBLAS_WORKSPACE_CONFIG (docs/training.md: what holds)."""


LOOP_SECTIONS = (DataConfig, OptimConfig, CheckpointConfig, RunConfig)
"""The loop's own settings, whose names no task option may take."""
