"""Python source parsed into an AST, past CPython 3.11's spurious ``SystemError``.

CPython 3.11 keeps the AST builder's recursion depth in per-interpreter state and misses its
adjustment on some paths (python/cpython#106905, fixed in 3.12): a parse while another thread
builds an AST may fail with "AST constructor recursion depth mismatch", though the source is
fine. The same parse again succeeds, so every parse of the project (the task's source at
``pulumi up``, the settings' help, the house's rules in the tests) goes through here.
"""

from __future__ import annotations

import ast

ATTEMPTS = 3
"""Parses before a ``SystemError`` is taken for real: each retry meets the race afresh."""


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, again on CPython 3.11's spurious ``SystemError``."""
    for _ in range(ATTEMPTS - 1):
        try:
            return ast.parse(source, filename=filename)
        except SystemError:
            continue
    return ast.parse(source, filename=filename)
