"""The DDP path, beside the sharded one: the emergency save (``bench/commit_deadline.py``'s
``one_eviction``, on fresh stores: the node-local file, then a DCP checkpoint of this process
alone) and the restore's peak RSS per rank: in ``agree_on_resume``
(training/checkpoints/resume.py) the holder loads the durable checkpoint into its live state,
item by item, and sends it tensor by tensor into the other rank's live tensors.

Each restoring rank first holds a state of the same size (its live replica of the model and
optimizer, as a DDP trainer's) and then resumes into it; the peak is read from the kernel's
high-water mark, reset before the resume.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from bench.commit_deadline import CommitPlan, large_state, measure_store
from bench.sharded_memory.peak_rss import _peak, _reset_peak
from bench.sharded_state.model import MIB, init_world
from training.checkpoints.resume import DurableSource, agree_on_resume
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.storage import FileStore

RESTORE_WORLD = 2


def _state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    return 0


def _restore_rank(rank: int, world: int, state_mib: int, root: str) -> None:
    import torch.distributed as dist

    base = Path(root)
    init_world(base, "ddp-restore", rank, world)
    try:
        runtime = _reset_peak()
        replica = large_state(state_mib)  # the live model and optimizer a trainer holds
        checkpoints = ShardedCheckpoints(FileStore(base / "durable"), base / f"scratch-{rank}")
        durable = DurableSource(checkpoints, lambda: replica)  # loaded into the live tensors
        dist.barrier()
        before = _reset_peak()
        started = time.perf_counter()
        resume = agree_on_resume(rank, torch.device("cpu"), None, durable, into=replica)
        seconds, peak = time.perf_counter() - started, _peak()
        assert resume.step == 1 and resume.state is not None, resume
        row = {
            "rank": rank,
            "share": _state_bytes(replica["model"]),
            "runtime": runtime,
            "before": before,
            "peak": peak,
            "restore_s": seconds,
        }
        (base / f"ddp-restore-{rank}.json").write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()


def measure_ddp_restore(state_mib: int, root: Path) -> list[dict[str, Any]]:
    """One checkpoint of ``state_mib`` MiB committed to a directory, restored by 2 ranks."""
    ShardedCheckpoints(FileStore(root / "durable"), root / "scratch").save_alone(
        large_state(state_mib), 1
    )
    mp.spawn(_restore_rank, args=(RESTORE_WORLD, state_mib, str(root)), nprocs=RESTORE_WORLD)
    return [json.loads((root / f"ddp-restore-{r}.json").read_text()) for r in range(RESTORE_WORLD)]


def measure_ddp(state_mib: int, stores: tuple[str, ...], say: Any) -> dict[str, Any]:
    """The emergency save per store (one eviction each) and the restore's peak RSS."""
    say(f"ddp: the single-file emergency save of {state_mib} MiB on {', '.join(stores)} ...")
    plan = CommitPlan(state_mb=state_mib, reps=1, stores=stores)
    plan.validate()
    evictions = {kind: measure_store(plan, kind, say) for kind in stores}
    say(f"ddp: the restore (agree_on_resume) at world {RESTORE_WORLD} ...")
    with tempfile.TemporaryDirectory(prefix="bench-ddp-restore-") as tmp:
        restore = measure_ddp_restore(state_mib, Path(tmp))
    return {"state_bytes": state_mib * MIB, "eviction": evictions, "restore": restore}
