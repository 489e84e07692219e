"""``shardc`` command line: one sub-command per module in :mod:`shardc.commands`.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Errors: :class:`shardc.errors.InputError` -> exit 2,
:class:`shardc.errors.InfeasibleError` -> exit 3, each as one line on stderr. Any other
exception is a bug: one line naming it (set ``SHARDC_DEBUG=1`` for the traceback), exit 1.
Every message is printed as exactly one line (:func:`one_line`): a multi-line exception text
(a torch.export error, an HF config error, a worker's traceback) is cut to its first line;
``SHARDC_DEBUG=1`` prints the full text.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import re
import signal
import sys

from shardc.errors import SIGNAL_EXIT, ShardcError, debugging, signal_received, signals_end_the_run

COMMANDS = ("compile", "inspect", "simulate", "bench", "verify", "calibrate")


MAX_MESSAGE_CHARS = 400  # a longer first line is cut (SHARDC_DEBUG=1 shows it all)
_FLAG_VALUE_ERROR = re.compile(r"^argument (--[\w-]+): (.*: expected .*)$", re.S)


def one_line(text: str) -> str:
    """``text`` as one line: its first non-empty line (whitespace runs squeezed), at most
    :data:`MAX_MESSAGE_CHARS` characters; when something was dropped, a note says how to see
    it. Under ``SHARDC_DEBUG=1`` the text is returned whole."""
    text = str(text)
    if debugging():
        return text
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    first = " ".join(lines[0].split()) if lines else ""
    cut = len(lines) > 1 or len(first) > MAX_MESSAGE_CHARS
    if len(first) > MAX_MESSAGE_CHARS:
        first = first[:MAX_MESSAGE_CHARS - 3] + "..."
    return first + (" (more with SHARDC_DEBUG=1)" if cut else "")


class _BadFlagValue(SystemExit):
    """A flag value refused by its ``type=`` check (:mod:`shardc.validate`): :func:`main`
    returns exit 2 for it like for any other bad input."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        m = _FLAG_VALUE_ERROR.match(message)  # our type= checks: "--flag VALUE: expected ..."
        if m:
            message = f"{m.group(1)} {m.group(2)}"
        sys.stderr.write(f"shardc: error: {one_line(message)}\n")
        raise (_BadFlagValue if m else SystemExit)(2)


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


# CPython's default collection thresholds (700, 10, 10) made a cold DeepSeek-V3 compile spend
# ~1.5 of ~10 CPU s re-scanning the millions of live objects torch, transformers and the IR
# graph hold; a young collection every 10,000 allocations still frees every cycle, as rarely
# as a short-lived command needs (peak memory unchanged: benchmarks/compile_cold.md).
GC_THRESHOLDS = (10_000, 20, 100)


@contextlib.contextmanager
def _collection_thresholds(thresholds: tuple[int, int, int]):
    """:func:`gc.set_threshold` for the block, the previous thresholds restored after it (a
    test calling :func:`main` in-process keeps its own)."""
    saved = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except _BadFlagValue as e:
        return int(e.code)
    with signals_end_the_run(), _collection_thresholds(GC_THRESHOLDS):
        code = _run(args)
        signum = signal_received()  # a library may have caught the signal's exception
    if signum is not None and code != SIGNAL_EXIT[signum]:
        if code == 0:  # finished (outputs, if any, were published before the signal came)
            sys.stderr.write(f"shardc: error: terminated by {signal.Signals(signum).name} "
                             "after the run had finished (its outputs, if any, are complete)\n")
        return SIGNAL_EXIT[signum]
    return code


def _run(args) -> int:
    try:
        return int(args._run(args) or 0)
    except ShardcError as e:
        sys.stderr.write(f"shardc: error: {one_line(str(e))}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("shardc: interrupted\n")
        return 130
    except BrokenPipeError:  # `shardc ... | head`: the reader left; outputs are already written
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a writer cut off by its pipe
    except Exception as e:  # a bug: say so in one line unless debugging
        if debugging():
            raise
        sys.stderr.write(f"shardc: internal error: {one_line(f'{type(e).__name__}: {e}')} "
                         "(set SHARDC_DEBUG=1 for the traceback)\n")
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
