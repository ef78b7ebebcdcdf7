"""The layout holds: modules a newcomer reads whole, each saying what it is for (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "router"
MAX_LINES = 400  # one job per module: past this, a module holds two


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_passes_400_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n for path in _modules() if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by job: {long}"


def test_every_module_says_what_it_is_for() -> None:
    silent = [str(path.relative_to(ROOT)) for path in _modules() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert not silent, silent


def test_the_rules_see_the_whole_package() -> None:
    # A check that finds nothing to check passes whatever the package holds.
    assert len(_modules()) > 100
    assert any(len(path.read_text().splitlines()) > MAX_LINES // 2 for path in _modules())
