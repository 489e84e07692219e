"""The two small types every torch-style emitter shares (:mod:`shardc.backends.torch_styles`,
:mod:`~shardc.backends.gathered_styles`, :mod:`~shardc.backends.pipeline_styles`): one line of
a ``parallelize_module`` plan, and the refusal of a plan no style covers yet."""

from __future__ import annotations

from dataclasses import dataclass


class NotCovered(ValueError):
    """The torch-style path does not (yet) cover this plan; the message says what."""


@dataclass
class Entry:
    """One line of a parallelize_module plan: module suffix, style code (built here from a
    fixed vocabulary, never from input) and the comment naming its collectives."""

    suffix: str
    style: str
    comment: str
