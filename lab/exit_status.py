"""What every ``python -m lab`` command shares: one help layout, and bad input said the same
way. The exit statuses are the training program's own (training/elastic/exit_codes.py): 0
done, 1 failed, 2 bad input (nothing was started)."""

from __future__ import annotations

import argparse
import sys
import textwrap

from training.elastic.exit_codes import BAD_INPUT


class HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, with a description's paragraphs (its lines) each wrapped on its own
    (``Exit status: ...`` stays a paragraph), and never a break inside ``--a-flag`` or
    ``spot-lab``."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            textwrap.fill(
                " ".join(paragraph.split()),
                width,
                initial_indent=indent,
                subsequent_indent=indent,
                break_on_hyphens=False,
            )
            for paragraph in text.splitlines()
        )


def bad_flag(flag: str, allowed: str, got: object) -> int:
    """Say on stderr, in one line, which flag is wrong and what it allows; the exit status.

    The training program's wording (``--lr must be > 0, got -1``), in every command."""
    print(f"error: {flag} must be {allowed}, got {got}", file=sys.stderr)
    return BAD_INPUT
