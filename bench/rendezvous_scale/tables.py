"""The figures of the runs: each node count's summary, its row, the model fitted on the rows,
and the table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from bench.rendezvous_scale import model
from bench.stats import summarize_known


def _values(reps: Sequence[dict[str, Any]], phase: str, *keys: str) -> list[float | None]:
    values: list[float | None] = []
    for rep in reps:
        value: Any = rep.get(phase)
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        values.append(value)
    return values


def summarize_reps(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max over the reps of every figure; false deaths summed."""
    return {
        "first_round_s": summarize_known(_values(reps, "first", "seconds")),
        "reform_death_s": summarize_known(_values(reps, "death", "seconds")),
        "reform_leave_s": summarize_known(_values(reps, "leave", "seconds")),
        "quiet_req_s": summarize_known(_values(reps, "quiet", "etcd", "req_s")),
        "reform_req_s": summarize_known(_values(reps, "death", "etcd", "req_s")),
        "reform_requests": summarize_known(_values(reps, "death", "etcd", "requests")),
        "reform_leave_req_s": summarize_known(_values(reps, "leave", "etcd", "req_s")),
        "reform_etcd_cpu_s": summarize_known(_values(reps, "death", "etcd", "etcd_cpu_s")),
        "reform_reads": summarize_known(_values(reps, "death", "etcd", "reads")),
        "reform_etcd_cores": summarize_known(_values(reps, "death", "etcd", "etcd_cpu_share")),
        "quiet_etcd_cores": summarize_known(_values(reps, "quiet", "etcd", "etcd_cpu_share")),
        "false_deaths": sum(rep["false_deaths"] for rep in reps),
        "errors": [rep["error"] for rep in reps if rep["error"]],
    }


def _median(summary: dict[str, Any], key: str) -> float | None:
    value = summary.get(key)
    return value["median"] if value else None


def measured_row(result: dict[str, Any], interval_s: float | None = None) -> dict[str, Any]:
    """``interval_s``: the heartbeat interval the agents ran with."""
    summary = result["summary"]
    keys = (
        "first_round_s",
        "reform_death_s",
        "reform_leave_s",
        "quiet_req_s",
        "reform_req_s",
        "reform_etcd_cores",
        "reform_reads",
    )
    return {
        "nodes": result["nodes"],
        "source": "measured",
        **{key: _median(summary, key) for key in keys},
        "false_deaths": summary["false_deaths"],
        "keep_alive_interval_s": interval_s,
        "freeze_found_s": model.freeze_found_s(interval_s),
    }


def build_model(
    measured: Sequence[dict[str, Any]], interval_s: float, nodes: Sequence[int]
) -> dict[str, Any]:
    """The model calibrated on every node count with all figures measured, or why not."""
    points = []
    for result in measured:
        summary = result["summary"]
        keys = ("first_round_s", "reform_death_s", "reform_leave_s", "quiet_req_s")
        medians = [_median(summary, key) for key in (*keys, "reform_requests", "reform_etcd_cpu_s")]
        if all(m is not None for m in medians):
            *figures, cpu_s = medians
            quiet = _median(summary, "quiet_etcd_cores") or 0.0  # not in older results
            # The re-form's own etcd CPU: its window's less the quiet rate over that window.
            own = max(cpu_s - quiet * medians[1], 0.0)  # type: ignore[operator]
            points.append(model.Point(result["nodes"], *figures, own, quiet))  # type: ignore[arg-type]
    if len({p.nodes for p in points}) < 2:
        return {"error": "the model needs complete measurements at two node counts or more"}
    cal = model.calibrate(points, interval_s)
    return {
        "calibration": asdict(cal),
        "assumptions": model.assumptions(cal),
        "rows": [model.predict(cal, n) for n in nodes if n > max(cal.nodes)],
    }


COLUMNS = (
    ("nodes", "N", "{:d}"),
    ("source", "source", "{}"),
    ("first_round_s", "first round s", "{:.2f}"),
    ("reform_death_s", "re-form after death s", "{:.2f}"),
    ("reform_leave_s", "re-form after leave s", "{:.2f}"),
    ("false_deaths", "false deaths", "{:d}"),
    ("keep_alive_interval_s", "heartbeat s", "{:g}"),
    ("freeze_found_s", "freeze found after s", "{:g}"),
    ("quiet_req_s", "etcd req/s quiet", "{:.1f}"),
    ("reform_req_s", "etcd req/s re-form", "{:.0f}"),
    ("reform_etcd_cores", "etcd cores re-form", "{:.2f}"),
    ("reform_reads", "etcd ranges re-form", "{:.0f}"),
)


def table_text(rows: Sequence[dict[str, Any]]) -> str:
    """Fixed-width table; a missing figure is '-', an unmodelled one 'n/a'."""

    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        value = row.get(key)
        if value is None:
            return "n/a" if row["source"] == "model" else "-"
        return fmt.format(value)

    cells = [[header for _, header, _ in COLUMNS]]
    cells += [[cell(row, key, fmt) for key, _, fmt in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report_text(results: dict[str, Any]) -> str:
    """The table, then what the measured and the modelled rows assume."""
    lines = [table_text(results["rows"]), "", "Measured rows:"]
    lines += [f"- {a}" for a in results["assumptions"]]
    fitted = results["model"]
    if "error" in fitted:
        lines += ["", f"No model: {fitted['error']}."]
    else:
        lines += ["", "Model rows:"] + [f"- {a}" for a in fitted["assumptions"]]
    return "\n".join(lines)
