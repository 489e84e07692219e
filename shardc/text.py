"""Render values that come from input (model, hardware, layer and parameter names) safely.

* :func:`one_line` -- a value as one line of plain ASCII text for a ``#`` comment or a
  docstring of generated code (no newline, quote or backslash survives unescaped);
* :func:`out_dir_name` -- a model name as one safe path component (the default ``--out``);
* :func:`number_or_dash` -- an optional number (``None`` in prefill's TPOT, say) as text;
* :func:`clean_text` -- a name from input made printable (no surrogate, control or format
  character) before it reaches any output: tables, titles of plots, plan.json.
"""

from __future__ import annotations

import math
import re

# Characters other than these become "_" in a directory name built from a model name.
_UNSAFE_PATH_CHARS = re.compile(r"[^A-Za-z0-9._-]")
OUT_DIR_NAME_MAX = 100  # characters
OUT_DIR_FALLBACK = "model"


def one_line(value) -> str:
    """``str(value)`` with every character that is not printable ASCII, and every ``"`` and
    ``\\``, written as a Python escape (``\\n``-style ``\\x0a``, ``\\u2028``, ``\\x22``).

    The result contains only printable ASCII without quotes or backslashes other than those
    starting an escape, so inside a ``#`` comment it cannot end the comment, and inside a
    (non-raw) docstring it cannot end the string and reads back as the original text."""
    out = []
    for ch in str(value):
        if ch.isascii() and ch.isprintable() and ch not in '"\\':
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out)


CLEAN_TEXT_MAX = 200  # characters of a name kept by clean_text


def clean_text(value, max_chars: int = CLEAN_TEXT_MAX) -> str:
    """``str(value)`` with every character that is not printable (surrogates, control and
    format characters, line and paragraph separators; ``str.isprintable``) written ``?``,
    at most ``max_chars`` characters. Printable non-ASCII text (``café``) is kept."""
    text = "".join(ch if ch.isprintable() else "?" for ch in str(value))
    return text if len(text) <= max_chars else text[:max_chars - 3] + "..."


def out_dir_name(model_name) -> str:
    """The default output folder's name for ``model_name``: one path component that stays
    inside ``./shardc_out/``. Characters other than ASCII letters, digits, ``.``, ``_`` and
    ``-`` become ``_`` (so ``/``, ``\\`` and NUL cannot make a path); leading dots are dropped
    (no ``.``, ``..`` or hidden folder); at most :data:`OUT_DIR_NAME_MAX` characters; an
    empty result is :data:`OUT_DIR_FALLBACK`. ``"Llama-3.1-70B"`` stays as it is."""
    name = _UNSAFE_PATH_CHARS.sub("_", str(model_name or "")).lstrip(".")
    return name[:OUT_DIR_NAME_MAX] or OUT_DIR_FALLBACK


def number_or_dash(value, spec: str = "") -> str:
    """``format(value, spec)`` for a finite int/float, ``"-"`` for anything else (``None``,
    NaN, a string from a hand-edited plan.json)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    return format(value, spec)
