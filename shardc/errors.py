"""User-facing errors. The CLI turns these into one line on stderr and an exit code.

* :class:`InputError` -- bad input (malformed mesh, unreadable file, bad plan): exit 2.
* :class:`InfeasibleError` -- a well-formed problem with no feasible plan: exit 3; the
  message says what is short (e.g. "needs >= 48 GPUs to hold weights + KV cache; mesh has 8").
"""


class ShardcError(Exception):
    exit_code = 1


class InputError(ShardcError):
    exit_code = 2


class InfeasibleError(ShardcError):
    exit_code = 3


class Terminated(ShardcError):
    """SIGTERM arrived while outputs were being written; they were rolled back (exit 143,
    the shell's code for a process ended by SIGTERM)."""

    exit_code = 143


def debugging() -> bool:
    """``SHARDC_DEBUG`` is set (to anything but empty or ``0``): full error texts, tracebacks,
    and the libraries' own logging while tracing."""
    import os

    return os.environ.get("SHARDC_DEBUG", "") not in ("", "0")
