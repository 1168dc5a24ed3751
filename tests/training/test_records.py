"""The records' contract (training/records.py): the writer refuses what the contract lacks,
every event the training program writes is in it with its fields, and the one reader skips
what is not a record."""

from __future__ import annotations

import ast
import io
import json
from pathlib import Path

import pytest

from training import python_source, records
from training.loop.dist import DistEnv
from training.loop.metrics import EventLog
from training.records import (
    CHECKPOINT_SAVED,
    EMERGENCY_SAVE,
    FIELDS,
    FINISHED,
    METRICS,
    RESUMED,
    STEP_COMPLETED,
    RecordError,
)

TRAINING = Path(__file__).resolve().parents[2] / "training"
WRITERS = ("event", "say")
"""The calls that write an event: ``EventLog.event(name, ...)`` and the agent's ``say``."""


def _log() -> tuple[EventLog, io.StringIO]:
    stream = io.StringIO()
    return EventLog(DistEnv(run_id="r1"), stream), stream


def test_a_field_the_contract_lacks_fails_the_writer() -> None:
    log, stream = _log()
    with pytest.raises(RecordError, match=r"resumed record has fields \['why'\]"):
        log.event(RESUMED, step=3, source="local", from_rank=0, lost_steps=0, world_size=2,
                  seconds=0.1, why="a field no reader knows")  # fmt: skip
    with pytest.raises(RecordError, match=r"metrics record has fields \['lr'\]"):
        log.metrics(step=1, epoch=0, world_size=1, loss=1.0, samples_per_s=2.0, lr=0.1)
    with pytest.raises(RecordError, match="event 'resumd' is not in training/records.py"):
        log.event("resumd", step=3)
    assert stream.getvalue() == ""  # nothing refused was written


def test_a_record_of_the_contract_is_written_with_the_lines_common_fields() -> None:
    log, stream = _log()
    log.event(FINISHED, step=4, loss=0.5, eval_loss=None)
    (record,) = records.read_lines(stream.getvalue())
    assert record["kind"] == records.EVENT and record["event"] == FINISHED
    assert record["run_id"] == "r1" and record["step"] == 4
    records.check(record)


def _written_events(root: Path) -> list[tuple[str, str, set[str]]]:
    """Every event written with a literal name under ``root``: (where, name, its keywords)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(python_source.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if called in WRITERS and isinstance(first, ast.Constant):
                keywords = {k.arg for k in node.keywords if k.arg is not None}
                where = f"{path.relative_to(root)}:{node.lineno}"
                found.append((where, str(first.value), keywords))
    return found


def test_every_event_the_training_program_writes_is_in_the_contract_with_its_fields() -> None:
    written = _written_events(TRAINING)
    assert len(written) >= 10, written  # the finder finds them
    assert not _beyond_the_contract(written)


def _beyond_the_contract(written: list[tuple[str, str, set[str]]]) -> list[str]:
    wrong = [
        f"{where}: {name} {sorted(keywords - FIELDS.get(name, frozenset()))}"
        for where, name, keywords in written
        if name not in FIELDS or not keywords <= FIELDS[name]
    ]
    return wrong


def test_the_finder_sees_an_event_or_a_field_the_contract_lacks(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(
        'log.event("resumed", step=1, why="no reader knows")\n'
        'say("data_copied", uri="u", files=1)\n'
        'self.events.event("resumd", step=1)\n'
    )
    written = _written_events(tmp_path)
    assert _beyond_the_contract(written) == ["w.py:1: resumed ['why']", "w.py:3: resumd ['step']"]


def test_the_reader_skips_stray_and_torn_lines_and_tags_the_node() -> None:
    good = {"ts": 1.0, "kind": METRICS, "step": 2, "world_size": 1, "loss": 0.5}
    other = {"ts": 2.0, "kind": "event", "event": RESUMED, "step": 2}
    torn = json.dumps(other)[:-7]
    text = "\n".join(["a stray print", json.dumps(good), '{"not": "a record"}', torn])
    assert records.read_lines(text, "node-1") == [{**good, "node": "node-1"}]
    assert records.parse(json.dumps(other)) == other
    assert records.parse('{"kind": "metrics"}') is None  # no time: not a record


def test_the_reader_reads_a_log_not_written_yet_as_empty(tmp_path: Path) -> None:
    assert records.read_log(tmp_path / "node-0.out") == []


def test_the_steps_a_record_shows_completed_and_durable() -> None:
    def event(name: str, **fields: object) -> dict[str, object]:
        return {"ts": 1.0, "kind": records.EVENT, "event": name, "step": 7, **fields}

    assert records.completed_step({"ts": 1.0, "kind": METRICS, "step": 7}) == 7
    for name in (CHECKPOINT_SAVED, EMERGENCY_SAVE, STEP_COMPLETED):
        assert records.completed_step(event(name)) == 7
    assert records.completed_step(event(RESUMED)) is None
    assert records.trained_step(event(STEP_COMPLETED)) == 7
    assert records.trained_step(event(CHECKPOINT_SAVED)) is None  # a save trains nothing
    assert records.acknowledged_step(event(CHECKPOINT_SAVED)) == 7
    assert records.acknowledged_step(event(FINISHED)) == 7
    assert records.acknowledged_step(event(EMERGENCY_SAVE, durable=True)) == 7
    assert records.acknowledged_step(event(EMERGENCY_SAVE, durable=False)) is None
    assert records.acknowledged_step(event(STEP_COMPLETED)) is None
