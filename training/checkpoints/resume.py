"""Elastic state: what a worker keeps on its node, and how the ranks agree where to resume.

On every (re)start each rank reports the newest state it can reach: its node's emergency save
(node-local disk, already verified) and the durable checkpoint the manifest names. The ranks
all-gather those claims, the holder of the newest one loads and verifies it, and sends it to the
others tensor by tensor (``state_transfer.py``), into their live tensors: no rank holds the
state serialized, and a node-local save is mapped from its file, not read into memory. A
durable checkpoint (``torch.distributed.checkpoint``, ``sharded/``) the holder loads into its
own live state, one item at a time, and sends from there. Every rank thus restores the same
state, even if one node read a stale cached manifest.

The agreement reads storage while the other ranks wait in a collective, so it runs on a
process group of its own whose timeout allows a slow store (``--restore-timeout-s``), not on
the default group, whose short timeout exists to detect a frozen peer during training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from training.checkpoints.checkpoint import CheckpointError, Entry
from training.checkpoints.node_local import NONE, Held, NodeLocalState
from training.checkpoints.sharded.repository import (
    DoesNotFitState,
    ShardedCheckpoints,
    global_rank,
)
from training.checkpoints.sharded.state import resolve
from training.checkpoints.state_transfer import share

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Resume:
    """Where this round starts."""

    state: dict[str, Any] | None
    step: int
    source: str
    """"fresh", "local" (a node's emergency save) or "durable"."""
    from_rank: int
    lost_steps: int | None
    """Progress any rank had recorded minus the resumed step; None when nothing was recorded."""
    seconds: float


# The holder's answer after it tried to materialise the winning claim.
_OK = 0
"""The state follows (``state_transfer.share``)."""
_LOWERED = 1
"""The durable checkpoint did not verify; every rank lowers that claim to the header's value."""
_UNREADABLE = 2
"""The holder cannot read the durable store; only the holder drops its durable claim."""
_MISFIT = 3
"""The durable checkpoint verifies but is not this state's (another model): every rank refuses,
as an older one would fail alike (``DurableSource.refuse``)."""


def _raise(step: int, error: CheckpointError) -> NoReturn:
    raise error


def _read(what: str, read: Callable[[], T]) -> tuple[T | None, bool]:
    """(result, failed): a storage error makes this rank claim nothing instead of crashing."""
    try:
        return read(), False
    except DoesNotFitState:
        raise  # not a storage error: the run's settings (``_MISFIT``)
    except (OSError, CheckpointError) as exc:
        logger.warning("cannot read the %s, so this rank claims none from it: %s", what, exc)
        return None, True


class DurableSource:
    """The durable checkpoints of a replicated (DDP) run, as the holder reads them: the head the
    manifest names, and the newest that verifies, loaded by this process alone into
    ``template()`` (the live state: its ``Stateful`` parts load in place, tensor by tensor)."""

    def __init__(
        self,
        checkpoints: ShardedCheckpoints,
        template: Callable[[], dict[str, Any]],
        refuse: Callable[[int, CheckpointError], NoReturn] | None = None,
    ) -> None:
        self.checkpoints, self.template = checkpoints, template
        self.refuse = refuse or _raise
        """Raises for a checkpoint of that step that does not fit (the trainer names the
        settings that differ): every rank calls it."""

    def head(self) -> Entry | None:
        return self.checkpoints.head()

    def load(self) -> Held | None:
        state = self.template()
        entry = self.checkpoints.load(state, alone=True)
        if entry is None:
            return None
        return Held(entry, resolve(state))


class _Claims:
    """This rank's candidates: a verified local save and the durable head (claimed, then loaded)."""

    def __init__(self, local: NodeLocalState | None, durable: DurableSource | None) -> None:
        self.local: Held | None = None
        if local is not None:
            self.local, _ = _read("node-local emergency save", local.restorable)
        self.durable = durable
        head, self.durable_failed = (None, False)
        if durable is not None:
            head, self.durable_failed = _read("durable checkpoint manifest", durable.head)
        self.durable_step = head.step if head else NONE
        self.durable_loaded: Held | None = None

    def row(self, progress: int) -> list[int]:
        local_step = self.local.entry.step if self.local else NONE
        return [local_step, self.durable_step, progress, int(self.durable_failed)]

    def materialize(self, source: str, step: int) -> tuple[int, int, Held | None]:
        """(outcome, value, state) for the winning claim, which this rank holds."""
        if source == "local":
            assert self.local is not None
            return _OK, 0, self.local
        if self.durable_loaded is None or self.durable_loaded.entry.step != step:
            assert self.durable is not None
            try:
                self.durable_loaded, failed = _read("durable checkpoint", self._load_durable)
            except DoesNotFitState as exc:
                logger.error("%s", exc)
                return _MISFIT, exc.entry.step, None
            if failed:
                return _UNREADABLE, NONE, None
        held = self.durable_loaded
        if held is not None and held.entry.step == step:
            return _OK, 0, held
        return _LOWERED, held.entry.step if held else NONE, None

    def _load_durable(self) -> Held | None:
        assert self.durable is not None
        return self.durable.load()

    def settle(self, outcome: int, value: int, step: int, holder: bool) -> None:
        """Apply a failed materialisation, so the next round agrees on what can be read."""
        if outcome == _UNREADABLE and holder:
            self.durable_step, self.durable_failed = NONE, True
        elif outcome == _LOWERED and (holder or self.durable_step == step):
            # The same manifest names the same object for every rank: all lower at once,
            # rather than each holder in turn downloading and rejecting it.
            self.durable_step = value


def _pick(rows: torch.Tensor) -> tuple[int, str, int]:
    """(step, source, rank) of the newest claim; local beats durable (no storage read)."""
    best = int(rows[:, :2].max())
    for column, source in ((0, "local"), (1, "durable")):
        holders = (rows[:, column] == best).nonzero()
        if len(holders):
            return best, source, int(holders[0])
    raise AssertionError("unreachable")


def _gather(row: list[int], device: torch.device, group: Any) -> torch.Tensor:
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered).cpu()


def _nothing_to_resume(rows: torch.Tensor, known: int, started: float) -> Resume:
    failed = (rows[:, 3] != 0).nonzero().flatten().tolist()
    if failed:
        # Starting fresh would train from step 0 over a run the store may still hold.
        raise CheckpointError(
            f"no rank could read the durable checkpoints (ranks {failed} failed) and none has "
            "an emergency save; refusing to start from step 0 (check --checkpoint-uri)"
        )
    lost = known if known != NONE else None
    return Resume(None, 0, "fresh", NONE, lost, time.monotonic() - started)


def agree_on_resume(
    rank: int,
    device: torch.device,
    local: NodeLocalState | None,
    durable: DurableSource | None,
    group: Any = None,
    into: dict[str, Any] | None = None,
) -> Resume:
    """All ranks of ``group`` (default: the world) call this together; they return the same state.

    ``rank`` is this process's rank in ``group``; ``device`` holds the collectives' tensors
    (the CPU for a gloo group, even when the default group is NCCL). ``into``: this rank's
    live state, which receives the holder's in place (``share``).
    """
    started = time.monotonic()
    claims = _Claims(local, durable)
    progress = local.progress() if local else NONE
    while True:
        rows = _gather(claims.row(progress), device, group)
        known = int(rows[:, 2].max())
        if int(rows[:, :2].max()) == NONE:
            return _nothing_to_resume(rows, known, started)
        step, source, holder = _pick(rows)
        outcome, value, held = (
            claims.materialize(source, step) if rank == holder else (_OK, 0, None)
        )
        header = torch.tensor([outcome, value], dtype=torch.int64, device=device)
        dist.broadcast(header, src=global_rank(group, holder), group=group)
        outcome, value = int(header[0]), int(header[1])
        if outcome == _MISFIT:
            assert durable is not None
            durable.refuse(
                value,
                CheckpointError(
                    f"the durable checkpoint of step {value} does not fit this state (rank "
                    f"{holder}'s log names the first difference)"
                ),
            )
        if outcome != _OK:
            claims.settle(outcome, value, step, rank == holder)
            continue
        # The holder parsed the checkpoint (one that verifies but cannot be read was passed
        # over there), so the others receive exactly the state the holder could read.
        source_rank = global_rank(group, holder)
        state = share(held.state if held else None, source_rank, device, group, into=into)
        lost = max(known - step, 0) if known != NONE else None
        return Resume(state, step, source, holder, lost, time.monotonic() - started)
