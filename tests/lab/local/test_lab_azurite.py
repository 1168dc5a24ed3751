"""The Azurite launcher the bench and the tests share (lab/local/azurite_server.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.local import azurite_server


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
