"""Every output block of README.md is what its command prints today (issue 19).

A block is marked by an HTML comment on the line before its fence::

    <!-- output of: shardc compile examples/mixtral_8x7b.py --mesh 8x128 ... -->
    ```
    ...
    ```

The test runs the command (in a fresh working directory with ``examples`` linked in, as a
user in the repository would) and compares its standard output with the block.
``SHARDC_UPDATE_DOCS=1`` rewrites the blocks instead. The worked example's command must be
the Makefile's ``make demo`` recipe, so the README shows what ``make demo`` prints.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_MARKED = re.compile(r"^<!-- output of: (?P<cmd>.+?) -->\n```\n(?P<out>.*?)^```\n", re.M | re.S)


def marked_blocks(text: str) -> list[re.Match]:
    """The README's output blocks with the command each shows, in order."""
    return list(_MARKED.finditer(text))


def demo_command() -> str:
    """The ``shardc ...`` command of the Makefile's ``demo`` recipe."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    recipe = lines[lines.index("demo: $(STAMP)") + 1].strip()
    assert recipe.startswith("$(BIN)/shardc "), recipe
    return recipe[len("$(BIN)/"):]


def run_shown(command: str, cwd: Path, capsys) -> str:
    """Standard output of ``command`` (a ``shardc ...`` line) run in-process from ``cwd``."""
    from shardc.cli import main

    argv = shlex.split(command)
    assert argv[0] == "shardc", command
    old = Path.cwd()
    os.chdir(cwd)
    try:
        capsys.readouterr()
        code = main(argv[1:])
        out = capsys.readouterr().out
    finally:
        os.chdir(old)
    assert code == 0, f"`{command}` exited {code}"
    return out


def test_the_worked_example_is_make_demo():
    commands = [m["cmd"] for m in marked_blocks(README.read_text())]
    assert demo_command() in commands, "README shows no output block of `make demo`'s command"


def test_readme_output_blocks_are_what_the_commands_print(tmp_path, capsys):
    text = README.read_text()
    blocks = marked_blocks(text)
    assert len(blocks) >= 2  # the worked example and the serving example
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    produced = {m["cmd"]: run_shown(m["cmd"], tmp_path, capsys) for m in blocks}
    if os.environ.get("SHARDC_UPDATE_DOCS") == "1":
        new = _MARKED.sub(lambda m: f"<!-- output of: {m['cmd']} -->\n```\n{produced[m['cmd']]}```\n",
                          text)
        README.write_text(new)
        pytest.skip("README output blocks rewritten")
    for m in blocks:
        assert produced[m["cmd"]] == m["out"], (
            f"README's output of `{m['cmd']}` is stale; rerun with SHARDC_UPDATE_DOCS=1 "
            "pytest tests/test_readme_output.py and commit README.md")
