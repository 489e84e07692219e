"""``shardc`` command line: one sub-command per module in :mod:`shardc.commands`.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Errors: :class:`shardc.errors.InputError` -> exit 2,
:class:`shardc.errors.InfeasibleError` -> exit 3, each as one line on stderr. Any other
exception is a bug: one line naming it (set ``SHARDC_DEBUG=1`` for the traceback), exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from shardc.errors import ShardcError

COMMANDS = ("compile", "inspect", "simulate", "bench", "verify")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        sys.stderr.write(f"shardc: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardc", description="Sharding compiler for distributed LLM inference.")
    from shardc import __version__

    parser.add_argument("--version", action="version", version=f"shardc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"shardc.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"shardc.commands.{name}":
                raise
            continue
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ShardcError as e:
        sys.stderr.write(f"shardc: error: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("shardc: interrupted\n")
        return 130
    except Exception as e:  # a bug: say so in one line unless debugging
        if os.environ.get("SHARDC_DEBUG"):
            raise
        sys.stderr.write(f"shardc: internal error: {type(e).__name__}: {e} "
                         "(set SHARDC_DEBUG=1 for the traceback)\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
