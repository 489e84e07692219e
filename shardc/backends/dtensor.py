"""Emit ``parallelize.py``: the plan as data plus one readable block per layer kind.

The emitted file defines ``parallelize(model, world_mesh=None)``. It creates the mesh with
``init_device_mesh`` from the plan's logical mesh when none is given and applies the plan
with torch's ParallelStyles and shardc's few own ones (:mod:`shardc.runtime`; the file is
written by :mod:`shardc.backends.emit_styles`), with comments naming each op's choice and
the collectives the strategy implies (from the contract's walk, the table the cost model
charges). The text writers every emitter shares (and the rules that keep input out of
code) are in :mod:`shardc.backends.emit_text`.
"""

from __future__ import annotations

from shardc.backends.emit_styles import emit_style_parallelize
from shardc.backends.torch_styles import NotCovered
from shardc.errors import InputError


def emit_parallelize(plan, standalone: bool = False) -> str:
    """``parallelize.py`` source for a :class:`shardc.plan.Plan` (ruff-clean, ASCII): per
    layer kind ``parallelize_module`` plans on torch's parallel API
    (:func:`shardc.backends.emit_styles.emit_style_parallelize`) importing
    ``shardc.runtime`` (torch-only), or, ``standalone``, with the runtime inlined (imports
    only torch). A plan the runtime cannot deploy (a hand-edited stage map, a layout no
    style places) raises InputError naming what.

    Names and numbers from the plan enter only through :func:`one_line` (docstring and
    comments) and :func:`_literal` (code); see the module doc."""
    try:
        return emit_style_parallelize(plan, inline=standalone)
    except NotCovered as e:
        raise InputError(f"parallelize.py: {e}") from None
