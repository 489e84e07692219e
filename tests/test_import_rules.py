"""The package's import graph follows the data flow (docs/design.md, "Import rules"): a
module imports only shardc packages of a lower rank than its own (or its own package), and
never a private (``_name``) of another package."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "shardc"

# rank of each top-level part of shardc: a part may import only parts of lower rank
RANKS = {
    "errors": 0, "runtime": 0, "version": 0,
    "text": 1, "validate": 1, "testing": 1, "cache": 1, "fingerprint": 1,
    "ir": 2,
    "cost": 3, "search": 3,
    "passes": 4, "serving": 4,
    "frontends": 5,
    "backends": 6, "plan_checks": 6,
    "plan": 7, "driver": 7, "launch_plan": 7,
    "api": 8,
    "commands": 9, "cli": 9, "__init__": 9,
}


def _part(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else path.stem


def _imports(path: Path):
    """(imported part, imported names, line) for each ``shardc.*`` import of ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mod = node.module.split(".")
            if mod[0] != "shardc":
                continue
            if len(mod) == 1:  # from shardc import x: x is a part (or the version)
                for a in node.names:
                    yield (a.name if a.name in RANKS else "__init__"), [a.name], node.lineno
            else:
                yield mod[1], [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                mod = a.name.split(".")
                if mod[0] == "shardc" and len(mod) > 1:
                    yield mod[1], [], node.lineno


def test_every_part_has_a_rank():
    parts = {_part(p) for p in PKG.rglob("*.py")}
    assert parts <= set(RANKS), f"give these a rank in RANKS: {sorted(parts - set(RANKS))}"


def test_no_upward_sideways_or_private_imports():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        me = _part(path)
        for target, names, line in _imports(path):
            where = f"{path.relative_to(PKG.parent)}:{line}"
            if target == "__init__" and names == ["__version__"]:
                continue  # the version string
            if target != me and RANKS[target] >= RANKS[me]:
                bad.append(f"{where}: {me} (rank {RANKS[me]}) imports {target} "
                           f"(rank {RANKS[target]})")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if target != me and private:
                bad.append(f"{where}: {me} imports private {private} of {target}")
    assert not bad, "\n".join(bad)
