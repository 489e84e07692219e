"""Checks for numbers that come from users (flags, TOML, plan.json), strict JSON in and out.

One place says what a valid number is: finite (no NaN, no infinity), inside a stated range,
an integer where a count is meant. :func:`check_number` is used by the library
(:class:`~shardc.ir.strategy.Workload`, :class:`~shardc.ir.strategy.Mesh`, hardware files,
plan.json) and, through :func:`int_arg` / :func:`float_arg` / :func:`batch_arg`, as the
argparse ``type=`` of every numeric flag, so a bad value is refused at parse time with one line.

The upper bounds (:data:`MAX_GPUS`, :data:`MAX_TOKENS`, ...) are far beyond any real cluster
or workload; they exist so that absurd values answer with a message instead of an overflow,
an hour of enumeration or a silly "needs >= 10^21 GPUs".
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import re

from shardc.errors import InputError

MAX_GPUS = 1_048_576  # GPUs in one mesh (2^20)
MAX_TOKENS = 100_000_000  # context / prompt length, tokens
MAX_BATCH = 1_048_576  # sequences per model replica
MAX_MS = 1e9  # SLOs, milliseconds (about 11.6 days; 1e6 already means "no SLO")
MAX_BUDGET = 10_000_000  # simulator evaluations of one search
MAX_SEED = 2**32 - 1
MAX_COUNT = 1_000_000  # other counts (seeds, jobs, layer index)

_INT_RE = re.compile(r"^\s*[+-]?[0-9]{1,30}\s*$")  # more digits than 30 is out of any range


def check_number(value, what: str, *, integer: bool = False, minimum: float | None = None,
                 maximum: float | None = None, above: float | None = None, unit: str = ""):
    """``value`` if it is a finite number (an ``int`` when ``integer``) with
    ``minimum <= value <= maximum`` and ``value > above`` (each bound optional); otherwise
    :class:`InputError` naming ``what``, the value and the accepted range (with ``unit``)."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real)  # numpy's too
    if ok and integer and not isinstance(value, numbers.Integral):
        ok = math.isfinite(value) and float(value).is_integer()
    value = (int(value) if integer else float(value)) if ok else value
    ok = ok and math.isfinite(value)
    ok = ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    ok = ok and (above is None or value > above)
    if not ok:
        shown = _show(value) if isinstance(value, numbers.Real) else repr(value)
        raise InputError(_bad(what, shown, describe_range(integer, minimum, maximum, above, unit)))
    return value


def describe_range(integer: bool, minimum=None, maximum=None, above=None, unit: str = "") -> str:
    """``"a positive integer <= 1048576 (GPUs)"``, ``"a finite number > 0 and <= 1e+09 (ms)"``."""
    conds = []
    if integer and minimum in (0, 1):
        kind = "a positive integer" if minimum == 1 else "a non-negative integer"
    else:
        kind = "an integer" if integer else "a finite number"
        conds += [f"{op} {_show(b)}" for op, b in ((">=", minimum), (">", above)) if b is not None]
    if maximum is not None:
        conds.append(f"<= {_show(maximum)}")
    text = " ".join([kind, " and ".join(conds)]) if conds else kind
    return text + (f" ({unit})" if unit else "")


def _show(x) -> str:
    """A number as a message shows it: ints in full below 10^16, else ``%g``."""
    if isinstance(x, bool):
        return repr(x)
    if isinstance(x, float) and math.isfinite(x) and x.is_integer() and abs(x) < 1e16:
        x = int(x)
    if isinstance(x, int) and abs(x) >= 10**16:
        return f"{float(x):g}"
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bad(what: str, shown: str, expected: str) -> str:
    """``--flag VALUE: expected ...`` / ``field = VALUE: expected ...`` / ``VALUE: expected ...``."""
    if not what:
        return f"{shown}: expected {expected}"
    bare_flag = what.startswith("--") and " " not in what
    return f"{what}{' ' if bare_flag else ' = '}{shown}: expected {expected}"


def _shown_text(s: str) -> str:
    return repr(s if len(s) <= 24 else s[:20] + "...")


def parse_int_text(text: str, what: str, **bounds) -> int:
    """An integer written in decimal digits (``"8"``, not ``"1e3"`` or ``"8.0"``), checked
    with :func:`check_number` (keywords ``minimum``, ``maximum``, ``unit``)."""
    s = str(text).strip()
    if not _INT_RE.match(s):
        raise InputError(_bad(what, _shown_text(s), describe_range(
            True, bounds.get("minimum"), bounds.get("maximum"), None, bounds.get("unit", ""))))
    try:
        return check_number(int(s), what, integer=True, **bounds)
    except InputError:  # say the number as it was written, not as %g
        raise InputError(_bad(what, _shown_text(s).strip("'"), describe_range(
            True, bounds.get("minimum"), bounds.get("maximum"), None,
            bounds.get("unit", "")))) from None


def parse_float_text(text: str, what: str, **bounds) -> float:
    """A finite decimal number (``"50"``, ``"0.5"``, ``"1e3"``; not nan/inf), checked with
    :func:`check_number` (keywords ``minimum``, ``maximum``, ``above``, ``unit``)."""
    s = str(text).strip()
    try:
        if not s.isascii():  # float() reads "１" (a fullwidth digit) as 1
            raise ValueError(s)
        value = float(s)
    except ValueError:
        raise InputError(_bad(what, _shown_text(s), describe_range(
            False, bounds.get("minimum"), bounds.get("maximum"), bounds.get("above"),
            bounds.get("unit", "")))) from None
    return check_number(value, what, **bounds)


def _arg(parse, name: str, **bounds):
    """argparse ``type=`` callable: InputError -> ArgumentTypeError (argparse then prints
    ``argument --flag: <message>`` as one line and exits 2)."""

    def convert(text: str):
        try:
            return parse(text, "", **bounds)
        except InputError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = name
    return convert


def int_arg(minimum: int = 1, maximum: int = MAX_COUNT, unit: str = ""):
    """argparse ``type=`` for an integer flag in ``[minimum, maximum]``."""
    return _arg(parse_int_text, "int", minimum=minimum, maximum=maximum, unit=unit)


def float_arg(above: float | None = 0.0, maximum: float | None = None,
              minimum: float | None = None, unit: str = ""):
    """argparse ``type=`` for a finite float flag (by default ``> 0``)."""
    return _arg(parse_float_text, "number", above=above, maximum=maximum, minimum=minimum,
                unit=unit)


def ascii_int(text: str) -> int:
    """argparse ``type=``: an integer in ASCII digits, any value (the command checks the
    range with its own message); ``int()`` would read ``"２"`` as 2."""
    if not _INT_RE.match(str(text)):
        raise argparse.ArgumentTypeError(f"{_shown_text(str(text))}: expected an integer "
                                         "(digits 0-9)")
    return int(text)


def ascii_float(text: str) -> float:
    """argparse ``type=``: a number in ASCII (``nan`` / ``inf`` pass, for the command's own
    message); ``float()`` would read fullwidth digits."""
    s = str(text).strip()
    try:
        if not s.isascii():
            raise ValueError(s)
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_shown_text(s)}: expected a number") from None


def batch_arg(text: str):
    """argparse ``type=`` for ``--batch N|auto``: None for auto, else an int in
    ``[1, MAX_BATCH]``."""
    if str(text).strip() == "auto":
        return None
    try:
        return parse_int_text(text, "", minimum=1, maximum=MAX_BATCH, unit="sequences")
    except InputError as e:
        raise argparse.ArgumentTypeError(f"{e}, or auto") from None


# ---------------------------------------------------------------------------- strict JSON
def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{text} is out of the range of a 64-bit float")
    return x


MAX_NESTING = 64  # levels of nested arrays / objects in a JSON or TOML input (plan.json: 6)


def _unique_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {_shown_text(key)}")
        out[key] = value
    return out


def check_nesting(value, what: str = "JSON") -> None:
    """ValueError when ``value`` (parsed JSON / TOML) nests arrays or objects deeper than
    :data:`MAX_NESTING` levels (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > MAX_NESTING:
                    raise ValueError(f"{what} nested more than {MAX_NESTING} levels deep")
                stack.append((child, depth + 1))


def loads_strict_json(text: str):
    """``json.loads`` that refuses ``NaN``, ``Infinity``, numbers that overflow a float,
    a key given twice in one object and nesting deeper than :data:`MAX_NESTING` (ValueError,
    like any other JSON error; a parser's RecursionError becomes one too)."""
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float,
                          object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError(f"JSON nested more than {MAX_NESTING} levels deep") from None
    check_nesting(data)
    return data


def dumps_strict_json(obj, **kwargs) -> str:
    """``json.dumps`` with ``allow_nan=False``: a NaN or infinity in an output is a bug
    (ValueError) instead of a file other tools cannot read."""
    return json.dumps(obj, allow_nan=False, **kwargs)


# ---------------------------------------------------------------------------- divisors
def divisors(n: int) -> list[int]:
    """Sorted divisors of ``n >= 1`` by trial division up to sqrt(n)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def is_prime(n: int) -> bool:
    """True for a prime ``n`` (trial division up to sqrt(n))."""
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True
