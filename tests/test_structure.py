"""The rooms stay small: no module of the service over 700 lines, no class over 30 methods
(methods inherited from the project's own classes counted, so a mixin split does not pass)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sessioncache", "tiers", "api")
MAX_LINES = 700
MAX_METHODS = 30


def sources() -> list[Path]:
    out: list[Path] = []
    for package in PACKAGES:
        out += [p for p in (ROOT / package).rglob("*.py") if not p.is_symlink()]
    return sorted(set(out))


def test_no_module_over_700_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_class_over_30_methods() -> None:
    classes: dict[str, list[tuple[set[str], list[str]]]] = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {
                    f.name
                    for f in node.body
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                }
                bases = [
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                ]
                classes.setdefault(node.name, []).append((methods, bases))

    def methods_of(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out: set[str] = set()
        for methods, bases in classes.get(name, []):
            out |= methods
            for base in bases:
                if base in classes and base not in seen and base != name:
                    out |= methods_of(base, seen | {name})
        return out

    fat = {name: n for name in classes if (n := len(methods_of(name))) > MAX_METHODS}
    assert not fat, f"classes over {MAX_METHODS} methods: {fat}"


def test_top_of_the_package_lists_its_parts() -> None:
    """The top of ``sessioncache/`` names the product's parts (at most 20 modules); the
    store's, the sessions' and the carriers' internals live in their packages."""
    top = sorted(
        p.name
        for p in (ROOT / "sessioncache").glob("*.py")
        if p.name != "__init__.py" and not p.is_symlink()
    )
    assert len(top) <= 20, f"{len(top)} modules directly under sessioncache/: {top}"
