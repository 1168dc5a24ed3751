"""The Azurite launcher the bench and the tests share (lab/local/azurite_server.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.local import azurite_server
from tests.support.waiting import wait_until


def test_it_looks_for_azurite_in_the_repos_own_node_modules() -> None:
    # The repo's package.json is what `npm ci` installs Azurite from.
    assert (azurite_server.REPO / "package.json").is_file()
    assert azurite_server.AZURITE_BLOB == azurite_server.REPO / "node_modules/.bin/azurite-blob"


def test_a_missing_azurite_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(azurite_server, "AZURITE_BLOB", tmp_path / "nothing")
    with (
        pytest.raises(ValueError, match=r"Azurite is not installed .*npm ci"),
        azurite_server.serve(tmp_path),
    ):
        pass


def test_azurite_sends_no_telemetry(tmp_path: Path, processes: None) -> None:
    # Azurite 3.35 sends usage data to Application Insights unless told not to
    # (node_modules/azurite/dist/src/blob/main.js: `init(location, !env.disableTelemetry())`);
    # tests and benchmarks never reach the network. Its debug log says which it chose at start.
    debug = tmp_path / "debug.log"
    with azurite_server.serve(tmp_path / "data", ["--debug", str(debug)]):
        wait_until(
            lambda: "Telemetry" in (debug.read_text() if debug.exists() else ""),
            30,
            "Azurite's telemetry decision in its debug log",
        )
    text = debug.read_text()
    assert "enableTelemetry: false" in text
    assert "Telemetry initialize successfully" not in text
