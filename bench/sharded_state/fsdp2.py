"""The FSDP2 cases, each world of ranks in spawned processes (gloo, on the CPU).

- ``save`` (the world that is evicted): every rank trains a step, the ranks save one periodic
  checkpoint together (``ShardedCheckpoints.save``), train one more step, then, at a barrier
  standing for the SIGTERM, each rank saves its part alone (``save_part``, no collective) and
  times it; once per store.
- ``killall``: a new, smaller world loads the newest committed checkpoint (the periodic one:
  the parts of a world killed without notice are never committed) and trains a step.
- ``evict``: a new, smaller world's coordinator joins the parts into one checkpoint
  (``complete``), every rank loads it resharded and trains a step. Rank ``r`` of the new world
  stands on the node of the old rank ``r`` (the last one was evicted): it reads the part files
  that node kept on its disk from there, the others from the store (``kept_files``).
- ``evict-store``: the same load again, every file read from the store, as before the nodes
  kept their parts: the difference is what the kept copies save.

Each rank writes one JSON row per case: times from ``perf_counter``, its share of the state,
and its peak RSS during the operation (the kernel's high-water mark, reset before it), next to
its RSS before any state (torch, gloo).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from bench.sharded_memory.peak_rss import _local_bytes, _peak, _reset_peak
from bench.sharded_state.model import build, init_world, train_step
from training.checkpoints.sharded.parts import complete, part_set_id, save_part
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.state import ModelState, TrainerState, training_state
from training.checkpoints.storage import FileStore, ObjectStore

PERIODIC_STEP, PART_STEP = 1, 2
ROUND = "bench-round"


def open_store(spec: dict[str, str]) -> ObjectStore:
    """A store from its description (picklable, for the spawned ranks)."""
    if spec["kind"] == "directory":
        return FileStore(Path(spec["root"]))
    from lab.local.azurite_server import ACCOUNT, ACCOUNT_KEY
    from training.checkpoints.blob_store import BlobStore, parse_blob_uri

    key = {"account_name": ACCOUNT, "account_key": ACCOUNT_KEY}
    return BlobStore(parse_blob_uri(spec["uri"]), key)


GRACE_S = 900.0
"""The commit's grace, past the default 120 s: on 2 shared cores a collective save of a
GB-scale state (every rank's file written, hashed and fsynced) took longer than half of it, and
the commit refused the checkpoint as possibly pruned. That was the product's fault, fixed since
(the grace runs from the oldest file's write: training/checkpoints/sharded/writer.py); kept here
so the run in docs/benchmarks.md is what this code measures. Only this process writes the
store, so nothing prunes under it."""


class _Kept(FileStore):
    """A node's kept part files, counting those a load linked from here."""

    linked = 0

    def link_into(self, name: str, path: Path) -> bool:
        found = super().link_into(name, path)
        self.linked += int(found)
        return found


def _checkpoints(
    spec: dict[str, str], base: Path, rank: int, kept: bool = False
) -> ShardedCheckpoints:
    scratch = base / f"scratch-{spec['kind']}-{rank}"
    node = _Kept(base / f"kept-{spec['kind']}-{rank}", fsync=False) if kept else None
    return ShardedCheckpoints(open_store(spec), scratch, grace_s=GRACE_S, kept=node)


def _write(base: Path, name: str, row: dict[str, Any]) -> None:
    (base / f"{name}.json").write_text(json.dumps(row))


def _save_world(
    rank: int, world: int, shape: tuple[int, int], specs: list[dict[str, str]], root: str
) -> None:
    base = Path(root)
    init_world(base, "save", rank, world)
    try:
        runtime = _reset_peak()
        layers, width = shape
        model, optimizer = build(layers, width, world, seed=0)
        trainer = TrainerState()
        state = training_state(ModelState(model, optimizer), trainer)
        train_step(model, optimizer, width)
        share = _local_bytes(model, optimizer)
        for spec in specs:
            checkpoints = _checkpoints(spec, base, rank, kept=True)
            trainer.step = PERIODIC_STEP
            dist.barrier()
            before = _reset_peak()
            started = time.perf_counter()
            checkpoints.save(state, PERIODIC_STEP)
            periodic_s, periodic_peak = time.perf_counter() - started, _peak()
            if spec is specs[0]:
                train_step(model, optimizer, width)
            trainer.step = PART_STEP
            dist.barrier()  # the SIGTERM: from here on no rank needs another
            before_part = _reset_peak()
            started = time.perf_counter()
            part = save_part(
                checkpoints, state, part_set_id("dcp", PART_STEP, ROUND), PART_STEP, rank, world
            )
            part_s = time.perf_counter() - started
            row = {
                "rank": rank,
                "share": share,
                "runtime": runtime,
                "periodic_s": periodic_s,
                "periodic_before": before,
                "periodic_peak": periodic_peak,
                "part_s": part_s,
                "part_bytes": part.file.size if part.file else 0,
                "part_before": before_part,
                "part_peak": _peak(),
            }
            _write(base, f"save-{spec['kind']}-{rank}", row)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _restore_world(
    rank: int, world: int, shape: tuple[int, int], spec: dict[str, str], case: str, root: str
) -> None:
    base = Path(root)
    init_world(base, f"{case}-{spec['kind']}", rank, world)
    try:
        runtime = _reset_peak()
        layers, width = shape
        # No step before: as in a trainer, the load creates the optimizer's moments.
        model, optimizer = build(layers, width, world, seed=1)
        trainer = TrainerState()
        state = training_state(ModelState(model, optimizer), trainer)
        checkpoints = _checkpoints(spec, base, rank, kept=case == "evict")
        dist.barrier()
        before = _reset_peak()
        started = time.perf_counter()
        complete_s = 0.0
        if case == "evict" and rank == 0:  # the new round's coordinator, alone
            completed = complete(checkpoints, newer_than=PERIODIC_STEP)
            assert completed is not None and completed.step == PART_STEP, completed
            complete_s = time.perf_counter() - started
        dist.barrier()  # the others wait for it (the trainer's broadcast of the plan)
        entry = checkpoints.load(state)
        loaded_s, peak = time.perf_counter() - started, _peak()
        wanted = PERIODIC_STEP if case == "killall" else PART_STEP
        assert entry is not None and entry.step == wanted == trainer.step, (entry, trainer.step)
        train_step(model, optimizer, width)
        row = {
            "rank": rank,
            "share": _local_bytes(model, optimizer),
            "runtime": runtime,
            "before": before,
            "peak": peak,
            "complete_s": complete_s,
            "loaded_s": loaded_s,
            "first_step_s": time.perf_counter() - started,
            "kept_files": checkpoints.kept.linked if isinstance(checkpoints.kept, _Kept) else 0,
        }
        _write(base, f"{case}-{spec['kind']}-{rank}", row)
    finally:
        dist.destroy_process_group()


def _rows(base: Path, name: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((base / f"{name}-{r}.json").read_text()) for r in range(world)]


def measure_fsdp2(
    shape: tuple[int, int],
    worlds: tuple[int, int],
    specs: list[dict[str, str]],
    root: Path,
    say: Any,
) -> dict[str, Any]:
    """Every case on every store: per store, the rows of ``save``, ``killall`` and ``evict``."""
    old, new = worlds
    say(f"fsdp2: world {old} trains and saves ({', '.join(s['kind'] for s in specs)}) ...")
    mp.spawn(_save_world, args=(old, shape, specs, str(root)), nprocs=old)
    found: dict[str, Any] = {}
    for spec in specs:
        kind = spec["kind"]
        found[kind] = {"save": _rows(root, f"save-{kind}", old)}
        # killall first: the parts are not committed yet; evict commits them for evict-store
        for case in ("killall", "evict", "evict-store"):
            say(f"fsdp2: {case} restore at world {new} from {kind} ...")
            mp.spawn(_restore_world, args=(new, shape, spec, case, str(root)), nprocs=new)
            found[kind][case] = _rows(root, f"{case}-{kind}", new)
    return found
