"""``--compile``: charlm compiled (inductor, on the CPU) trains through a fault in the middle of
gradient accumulation and loses no step; the resumed run ends where an uninterrupted compiled
run ends. Under fsdp2, which modules are compiled (the elastic run with a fault:
tests/training/test_elastic_training_fsdp2_compile.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn
from torch.distributed.fsdp import fully_shard

from tests.support.exactness import (
    TOLERANCE,
    flags,
    make_data,
    matches,
    raising_in_micro_batch,
    reference,
    run_here,
)
from tests.support.peer_failures import gloo_peer_closed
from tests.support.trainer_harness import one_process_world
from training.elastic.exit_codes import OK, WORKER_RESTART
from training.loop.parallel import compile_model
from training.records import EMERGENCY_SAVE, RESUMED
from training.tasks import TASKS

pytestmark = pytest.mark.timeout(900)


@pytest.mark.usefixtures("processes", "training")  # inductor runs the C++ compiler
def test_compiled_charlm_loses_no_step_to_a_fault(tmp_path: Path) -> None:
    data = make_data("charlm", tmp_path / "data")
    args = flags("charlm", "--compile=true", "--dropout=0.1", "--max-steps=8")
    expected = reference(tmp_path / "reference", data, args)
    faulty = raising_in_micro_batch(TASKS["charlm"], step=5, micro_batch=1, error=gloo_peer_closed)
    first, code = run_here(tmp_path / "run", data, args, spec=faulty)
    assert code == WORKER_RESTART
    assert getattr(first.trainer.model, "_compiled_call_impl", None) is not None  # compiled
    (save,) = first.events(EMERGENCY_SAVE)
    assert (save["step"], save["reason"]) == (5, "peer_failure")
    second, code = run_here(tmp_path / "run", data, args)
    assert code == OK
    (resumed,) = second.events(RESUMED)
    assert (resumed["source"], resumed["step"], resumed["lost_steps"]) == ("local", 5, 0)
    assert matches(tmp_path / "run", expected) < TOLERANCE


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Linear(4, 4), nn.Linear(4, 4)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))


def test_under_fsdp2_the_outermost_sharded_units_below_the_root_compile_in_place() -> None:
    """As torchtitan compiles each transformer block: a unit inside a block rides along with
    it, the root stays eager; the keys of the state stay the same (``module.compile()``, not
    ``torch.compile(module)``, which would add ``_orig_mod.``). A model sharded only at its
    root gets the root compiled."""
    with one_process_world():
        model = _Model()
        keys = list(model.state_dict())
        for block in model.blocks:
            fully_shard(block.inner)
            fully_shard(block)
        fully_shard(model)
        compile_model(model, "fsdp2")
        compiled = {n for n, m in model.named_modules() if m._compiled_call_impl is not None}
        assert compiled == {"blocks.0", "blocks.1"}
        assert list(model.state_dict()) == keys
        alone = _Model()
        fully_shard(alone)
        compile_model(alone, "fsdp2")
        assert alone._compiled_call_impl is not None
