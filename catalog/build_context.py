"""What an image build sees of its context: every file ``.dockerignore`` does not exclude.

The training image's tag hashes exactly these files, so a file the build never receives
(a test cache, an editor's swap file) cannot change the tag. The rules follow Docker's
(moby/patternmatcher, as ``docker build`` applies them; ``az acr build`` has its own reading,
the same but for a pattern's leading or trailing '/', which it keeps and so matches nothing:
``stack_config/task_package.py`` refuses such a line in a task package):

- patterns are relative to the context root; a leading '/' is dropped; ``#`` starts a comment;
- ``*`` and ``?`` never match '/'; ``**`` matches any number of directories, even none;
- a pattern that matches a directory excludes everything below it;
- ``!pattern`` re-includes, and the last pattern that matches a path decides.

The Dockerfile being built always counts: the builder reads it even when ``.dockerignore``
lists it, and it defines the image. Pure: no pulumi import.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

DOCKERFILE = "Dockerfile"
DOCKERIGNORE = ".dockerignore"
# Characters with a regex meaning but none in a Go filepath pattern (escaped literally);
# '^' stays raw as in moby, for '[^...]' classes.
_LITERAL = set(".+()|{}$")


@dataclass(frozen=True)
class IgnorePattern:
    """One ``.dockerignore`` line, compiled."""

    pattern: str
    exclusion: bool
    """True for ``!pattern``: it re-includes what earlier lines excluded."""
    regex: re.Pattern[str]

    def matches(self, path: str) -> bool:
        """Whether ``path`` (relative, '/'-separated) or one of its parent dirs matches."""
        parts = path.split("/")
        return any(self.regex.match("/".join(parts[:i])) for i in range(len(parts), 0, -1))


def _to_regex(pattern: str) -> re.Pattern[str]:
    out, i = ["^"], 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
            out.append(".*" if i >= len(pattern) else "(.*/)?")
            continue
        if ch == "*":
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        elif ch in _LITERAL:
            out.append("\\" + ch)
        else:  # letters, digits, '/', '-', and '[...]' classes pass through as in Go
            out.append(ch)
        i += 1
    return re.compile("".join(out) + "$")


def parse_dockerignore(text: str) -> list[IgnorePattern]:
    """The patterns of a ``.dockerignore`` file, in order."""
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        body = line[1:].strip() if exclusion else line
        body = posixpath.normpath(body).lstrip("/") if body else body
        if body:
            patterns.append(IgnorePattern(line, exclusion, _to_regex(body)))
    return patterns


def is_ignored(path: str, patterns: list[IgnorePattern]) -> bool:
    """Docker's decision for one context path: the last matching pattern wins."""
    ignored = False
    for pattern in patterns:
        # An exclusion only matters for a path already ignored, and the other way round.
        if pattern.exclusion == ignored and pattern.matches(path):
            ignored = not pattern.exclusion
    return ignored


def context_files(root: Path, dockerfile: str = DOCKERFILE) -> list[Path]:
    """Files under ``root`` the build receives, sorted by relative path, plus the Dockerfile it
    builds (``dockerfile``, relative to ``root``).

    An ignored folder is not walked when no ``!`` line could take anything back from it, as
    Docker skips it (moby ``pkg/archive`` ``TarWithOptions``: "No exceptions (!...) in patterns
    so just skip dir"): a repository's data folder costs nothing at every preview."""
    ignore_file = root / DOCKERIGNORE
    patterns = parse_dockerignore(ignore_file.read_text()) if ignore_file.is_file() else []
    prune = not any(p.exclusion for p in patterns)
    files = []
    for folder, dirs, names in os.walk(root):
        base = Path(folder).relative_to(root).as_posix()
        base = "" if base == "." else base
        if prune:
            dirs[:] = [
                d
                for d in dirs
                if dockerfile.startswith(f"{base}/{d}/".lstrip("/"))
                or not is_ignored(f"{base}/{d}".lstrip("/"), patterns)
            ]
        for name in names:
            relative = f"{base}/{name}".lstrip("/")
            path = Path(folder) / name
            if path.is_file() and (relative == dockerfile or not is_ignored(relative, patterns)):
                files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())
