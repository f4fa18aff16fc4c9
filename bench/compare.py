"""Before and after in one run: a benchmark of this tree and the same benchmark of another
source tree (another commit: ``git worktree add DIR <commit>`` or ``git archive <commit> | tar
-x -C DIR``), run in turns, round after round, each as its own process with its own node and
its own client code (both ends of a data plane move together), so that noise from elsewhere on
the machine hits both alike.

Benchmarks take ``--compare-tree`` themselves (``bench.dataplane``, ``bench.ttft``), or this
module runs one: ``python -m bench.compare TARGET --compare-tree DIR [--compare-rounds 5]
[--lower SUFFIX ...] [ARGS]``, where ``TARGET`` is a module (``bench.x``) or a file of this
tree's run against both trees' code (a benchmark new in this tree, on public APIs only).

Every run ends with the benchmark's ``--json`` line; each figure keeps its best round (the
highest of a rate, the lowest of a time) and is printed beside the other tree's, as a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def run_once(module: str, args: Sequence[str], tree: Path) -> dict[str, Any]:
    """One run of ``python -m <module> <args> --json`` from ``tree``; its JSON line. A
    ``module`` that is a file path (a benchmark of this tree's using only public APIs) runs
    as that file, against ``tree``'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # a file runs with the tree as its first path entry (not the file's own folder)
    run_file = f"import runpy; runpy.run_path({module!r}, run_name='__main__')"
    command = ["-c", run_file] if module.endswith(".py") else ["-m", module]
    out = subprocess.run(
        [sys.executable, *command, *args, "--json"],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    last = out.strip().splitlines()[-1]
    result: dict[str, Any] = json.loads(last)
    return result


def flatten(result: dict[str, Any], prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def compare(
    module: str,
    args: Sequence[str],
    other: Path,
    *,
    rounds: int,
    lower_is_better: Callable[[str], bool],
    label: str = "base",
    references: dict[str, str] | None = None,
) -> dict[str, tuple[float, float]]:
    """Run ``module`` from this tree and from ``other`` in turns, ``rounds`` times each, and
    print each figure's best beside the other's; returns ``{figure: (this, other)}``.

    ``references`` maps a figure to a reference figure of the same run (a plain socket for a
    stream rate): each run's figure is also divided by its own run's reference, and the best
    of those shares printed, which cancels the noise that slows a whole run."""
    trees = {"this": HERE, label: other.resolve()}
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    for r in range(rounds):
        for name, tree in trees.items() if r % 2 == 0 else reversed(trees.items()):
            figures = flatten(run_once(module, args, tree))
            for key, ref in (references or {}).items():
                if key in figures and figures.get(ref):
                    figures[f"{key} / {ref}"] = figures[key] / figures[ref]
            for key, value in figures.items():
                seen = best[name].get(key)
                better = min if lower_is_better(key) else max
                best[name][key] = value if seen is None else better(seen, value)
            print(f"round {r + 1}/{rounds}: {name} done", file=sys.stderr)
    print(f"{module} {' '.join(args)}: best of {rounds}, this tree vs {label} ({other})")
    print(f"{'figure':<34} {'this':>10} {label:>10} {'this/' + label:>10}")
    both: dict[str, tuple[float, float]] = {}
    for key in sorted(set(best["this"]) & set(best[label])):
        a, b = best["this"][key], best[label][key]
        both[key] = (a, b)
        ratio = a / b if b else float("nan")
        print(f"{key:<34} {a:>10.4g} {b:>10.4g} {ratio:>10.3f}")
    return both


COMPARE_FLAGS = ("--compare-tree", "--compare-rounds", "--compare-label")


def add_arguments(parser: Any) -> None:
    """``--compare-tree DIR [--compare-rounds 5] [--compare-label base]`` on a benchmark."""
    parser.add_argument(
        "--compare-tree",
        type=Path,
        help="another source tree: run this benchmark from it and from this tree in turns",
    )
    parser.add_argument("--compare-rounds", type=int, default=5)
    parser.add_argument("--compare-label", default="base")


def run_if_asked(
    args: Any,
    module: str,
    *,
    lower_is_better: Callable[[str], bool],
    references: dict[str, str] | None = None,
) -> bool:
    """With ``--compare-tree`` given: run ``module`` (with this command line's own arguments)
    from both trees in turns and print them side by side; whether it did."""
    if args.compare_tree is None:
        return False
    compare(
        module,
        forwarded(sys.argv[1:]),
        args.compare_tree,
        rounds=args.compare_rounds,
        lower_is_better=lower_is_better,
        label=args.compare_label,
        references=references,
    )
    return True


def forwarded(argv: Sequence[str]) -> list[str]:
    """The benchmark's own arguments of ``argv`` (without the compare flags and ``--json``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in COMPARE_FLAGS:
            skip = "=" not in arg
            continue
        if arg != "--json":
            out.append(arg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target", help="a module (bench.x) or a benchmark file of this tree")
    add_arguments(parser)
    parser.add_argument(
        "--lower", nargs="*", default=["_s", "_ms"], help="suffixes of figures where lower wins"
    )
    ns, rest = parser.parse_known_args()
    if ns.compare_tree is None:
        parser.error("--compare-tree is required")
    target = ns.target
    if target.endswith(".py"):
        target = str(Path(target).resolve())
    forwarded_args = [a for a in rest if a != "--"]
    compare(
        target,
        forwarded_args,
        ns.compare_tree,
        rounds=ns.compare_rounds,
        lower_is_better=lambda key: key.endswith(tuple(ns.lower)),
        label=ns.compare_label,
    )


if __name__ == "__main__":
    main()
