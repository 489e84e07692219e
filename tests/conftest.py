"""Which dependency versions this run uses, against the lock (constraints.txt).

The header of every run lists the installed releases that differ from the lock; a failing run
repeats them at the end ("transformers 5.25.0 (locked 5.24.0)"), so a failure caused by a
new upstream release is named where it shows (`make test-latest`, README "Troubleshooting").
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

LOCK = Path(__file__).resolve().parents[1] / "constraints.txt"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(path: Path | None = None) -> dict[str, str]:
    """{canonical name: version} of the lock's ``name==version`` lines (default: :data:`LOCK`)."""
    path, out = path or LOCK, {}
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[_canonical(name)] = version.strip()
    return out


def versions_off_the_lock() -> list[str]:
    """``"name installed (locked X)"`` for every locked package installed at another version
    (a local build tag such as torch's ``+cpu`` is not a difference)."""
    off = []
    for name, locked in sorted(locked_versions().items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if have.split("+", 1)[0] != locked.split("+", 1)[0]:
            off.append(f"{name} {have} (locked {locked})")
    return off


def pytest_report_header(config):
    off = versions_off_the_lock()
    if not off:
        return "dependencies: the versions of constraints.txt"
    return "dependencies other than constraints.txt: " + ", ".join(off)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    off = versions_off_the_lock()
    if exitstatus not in (0, 5) and off:
        terminalreporter.section("dependency versions")
        for item in off:
            terminalreporter.write_line(f"{item}: this run used a release other than the lock")
        terminalreporter.write_line("`make test` installs the locked set (README, Troubleshooting)")
