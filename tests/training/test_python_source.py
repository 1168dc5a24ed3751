"""The one parse of Python source: CPython 3.11's spurious SystemError is parsed past."""

from __future__ import annotations

import ast

import pytest

from training import python_source

SPURIOUS = "AST constructor recursion depth mismatch (before=141, after=191)"


def _parse_failing(monkeypatch: pytest.MonkeyPatch, times: int) -> list[object]:
    real_parse, calls = ast.parse, []

    def parse(*args: object, **kwargs: object) -> ast.Module:
        calls.append(args)
        if len(calls) <= times:
            raise SystemError(SPURIOUS)
        return real_parse(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ast, "parse", parse)
    return calls


def test_a_spurious_ast_error_of_cpython_311_is_parsed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _parse_failing(monkeypatch, python_source.ATTEMPTS - 1)
    tree = python_source.parse("x = 1\n", "m.py")
    assert isinstance(tree.body[0], ast.Assign) and len(calls) == python_source.ATTEMPTS


def test_an_error_that_stays_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _parse_failing(monkeypatch, python_source.ATTEMPTS)
    with pytest.raises(SystemError, match="recursion depth mismatch"):
        python_source.parse("x = 1\n", "m.py")
    assert len(calls) == python_source.ATTEMPTS


def test_a_syntax_error_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _parse_failing(monkeypatch, 0)
    with pytest.raises(SyntaxError):
        python_source.parse("x = = 1\n", "m.py")
    assert len(calls) == 1
