"""User-facing errors. The CLI turns these into one line on stderr and an exit code.

* :class:`InputError` -- bad input (malformed mesh, unreadable file, bad plan): exit 2.
* :class:`InfeasibleError` -- a well-formed problem with no feasible plan: exit 3; the
  message says what is short (e.g. "needs >= 48 GPUs to hold weights + KV cache; mesh has 8").
* :class:`Terminated` -- SIGTERM (exit 143) or SIGINT (exit 130) arrived; no outputs.

Signals: :func:`signals_end_the_run` (the CLI, for the whole run) makes SIGTERM / SIGINT
record themselves (:func:`signal_received`) before raising, so a library that catches the
exception (``except Exception`` around an optional import) cannot turn a terminated run into
a finished one: the output writers (:mod:`shardc.backends.atomic`) refuse to publish and the
CLI exits 143 / 130 once any signal was recorded.
"""

import signal
import threading
from contextlib import contextmanager


class ShardcError(Exception):
    exit_code = 1


class InputError(ShardcError):
    exit_code = 2


class InfeasibleError(ShardcError):
    exit_code = 3


class Terminated(ShardcError):
    """SIGTERM (exit 143, the shell's code for a process ended by SIGTERM) or SIGINT (130)
    arrived; outputs being written were rolled back, none were published."""

    exit_code = 143

    def __init__(self, message: str, exit_code: int = 143):
        super().__init__(message)
        self.exit_code = exit_code


SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}
_received: list[int] = []  # signals that arrived while handlers were installed (this run)


def signal_received() -> int | None:
    """The first SIGTERM / SIGINT recorded since :func:`signals_end_the_run` began, or None."""
    return _received[0] if _received else None


def terminated_error(signum: int, what: str = "") -> Terminated:
    """The :class:`Terminated` for ``signum`` (``what``: what was being done, optional)."""
    name = signal.Signals(signum).name
    text = f"terminated by {name}" + (f" while {what}" if what else "") + "; no outputs written"
    return Terminated(text, SIGNAL_EXIT.get(signum, 143))


@contextmanager
def signals_end_the_run(what: str = ""):
    """While the block runs (main thread only), SIGTERM raises :class:`Terminated` (exit 143)
    and SIGINT ``KeyboardInterrupt`` (exit 130), each recorded first (module docstring);
    inside :func:`signals_deferred` they are only recorded. Nested uses keep the outer
    handlers. The previous handlers are restored afterwards."""
    if threading.current_thread() is not threading.main_thread() or _installed:
        yield
        return

    def handler(signum, frame):
        _received.append(signum)
        if _deferring:  # an atomic step is under way: it checks signal_received() itself
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise terminated_error(signum, what)

    previous = {s: signal.signal(s, handler) for s in SIGNAL_EXIT}
    _installed.append(True)
    _received.clear()
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _installed.clear()


@contextmanager
def signals_deferred():
    """Inside :func:`signals_end_the_run`: a signal is recorded but raises nothing until the
    block ends (so a write and its roll-back are never cut in the middle); the block checks
    :func:`check_not_terminated` where stopping is safe."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()


_installed: list[bool] = []
_deferring: list[bool] = []


def check_not_terminated(what: str = "") -> None:
    """Raise :class:`Terminated` if a signal was recorded (a library swallowed its exception)."""
    signum = signal_received()
    if signum is not None:
        raise terminated_error(signum, what)


def debugging() -> bool:
    """``SHARDC_DEBUG`` is set (to anything but empty or ``0``): full error texts, tracebacks,
    and the libraries' own logging while tracing."""
    import os

    return os.environ.get("SHARDC_DEBUG", "") not in ("", "0")
