"""What the docs' tests read off a Markdown page: its fenced blocks, the commands of its shell
blocks, its relative links and the anchors GitHub gives its headings."""

from __future__ import annotations

import re
from pathlib import Path

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def fenced_blocks(text: str, language: str) -> list[str]:
    """The bodies of the fences opened with ``language`` (``""``: no language), in order."""
    return [body for lang, body in _FENCE.findall(text) if lang == language]


def shell_commands(block: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped,
    runs of spaces made one."""
    commands: list[str] = []
    for line in block.splitlines():
        line = line.split("  #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if commands and commands[-1].endswith("\\"):
            commands[-1] = commands[-1][:-1] + " " + line
        else:
            commands.append(line)
    return [" ".join(command.split()) for command in commands]


def _prose(text: str) -> str:
    """``text`` without its fenced blocks, whose lines may look like headings or links."""
    return _FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    """The anchors GitHub makes of the page's headings: lower case, punctuation but ``-`` and
    ``_`` dropped, spaces made ``-``; a repeated one gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(text: str) -> list[str]:
    """The targets of the page's links that are neither absolute URLs nor mail."""
    return [
        target
        for target in _LINK.findall(_prose(text))
        if not re.match(r"[a-z]+:", target) and not target.startswith("//")
    ]


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file, or whose anchor in that file, is missing."""
    wrong = []
    for target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            wrong.append(f"{page.name}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            wrong.append(f"{page.name}: {target} (no such heading in {file.name})")
    return wrong
