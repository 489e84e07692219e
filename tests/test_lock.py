"""The lock (constraints.txt) against pyproject's declared ranges, and the run's report of
releases off the lock (issue 19)."""

from __future__ import annotations

from pathlib import Path

import conftest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def declared() -> list[Requirement]:
    """pyproject's dependencies and the extras `make test` installs (dev, sb3)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["dev"] + extras["sb3"]]


def test_the_lock_pins_every_declared_dependency_inside_its_range():
    locked = conftest.locked_versions()
    for req in declared():
        name = conftest._canonical(req.name)
        assert name in locked, f"constraints.txt does not pin {req.name}"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={locked[name]}, outside pyproject's {req}")


def test_a_release_off_the_lock_is_named(tmp_path, monkeypatch):
    lock = tmp_path / "constraints.txt"
    lock.write_text("# a comment\ntransformers==0.0.1\nnumpy==0.0.2  # trailing\n"
                    "not-installed-anywhere==1.0\n")
    monkeypatch.setattr(conftest, "LOCK", lock)
    off = conftest.versions_off_the_lock()
    assert [o.split()[0] for o in off] == ["numpy", "transformers"]
    assert off[1].endswith("(locked 0.0.1)")
    lock.write_text("".join(f"{o.split()[0]}=={o.split()[1]}\n" for o in off))
    assert conftest.versions_off_the_lock() == []
