"""Does a model match the plan made for it? (torch-free; inlined by ``--standalone``.)

A plan records its model's parameter table (plan.json ``model.fingerprint``):

* ``table``: ``[[pattern, shape, count], ...]`` -- each parameter name with every numeric
  path component written ``*`` (``model.layers.*.mlp.experts.*.w1.weight``), its shape and
  how many parameters share both; readable, a few dozen rows even for DeepSeek-V3;
* ``params``: a checksum of the exact table (every name and shape);
* ``roles``: a checksum of every params row's name, fused op and decoder layer (the plan's own
  rows: a row deleted, moved to another layer or given another op no longer matches).

:func:`check_model` compares a model's ``named_parameters()`` with the table and raises
:class:`ModelMismatch` (a ``ValueError``) naming the first difference; ``Plan.apply``, the
emitted ``parallelize.py`` (the default file and the ``--standalone`` one, which inlines
this module) and ``shardc verify`` call it before placing anything.
"""

from __future__ import annotations

_DIGEST_MODULUS = (1 << 127) - 1  # a Mersenne prime: digests are 32 hex digits


class ModelMismatch(ValueError):
    """The model is not the one the plan was made for (the message names the first
    difference)."""


def name_pattern(fqn: str) -> str:
    """``fqn`` with every all-digit path component replaced by ``*`` (layer and expert
    indices)."""
    return ".".join("*" if p.isdigit() and p.isascii() else p for p in str(fqn).split("."))


def _digest(items) -> str:
    """A checksum of ``items`` (lists of str / int / None; order-independent): the ASCII
    text of the sorted items as one integer modulo 2^127 - 1. It tells an edited table from
    the recorded one; it is not a signature (anyone can recompute it), and needs no import
    (the ``--standalone`` file imports only torch)."""
    text = ascii(sorted(items, key=ascii))
    return f"{int.from_bytes(text.encode('ascii'), 'big') % _DIGEST_MODULUS:032x}"


def table_of(shapes: dict[str, list[int]]) -> list[list]:
    """``[[pattern, shape, count], ...]`` of ``{fqn: shape}`` (sorted by pattern, shape)."""
    counts: dict[tuple, int] = {}
    for fqn, shape in shapes.items():
        key = (name_pattern(fqn), tuple(int(s) for s in shape))
        counts[key] = counts.get(key, 0) + 1
    return [[p, list(s), n] for (p, s), n in sorted(counts.items())]


def fingerprint(rows: list[dict]) -> dict:
    """plan.json ``model.fingerprint`` of the params rows (module docstring)."""
    shapes = {str(r["fqn"]): [int(s) for s in r["shape"]] for r in rows}
    return {"params": _digest([[f, s] for f, s in shapes.items()]),
            "roles": _digest([[str(r["fqn"]), r.get("op"), r.get("layer")] for r in rows]),
            "table": table_of(shapes)}


def model_shapes(model) -> dict[str, list[int]]:
    """``{fqn: shape}`` of ``model.named_parameters()`` (a tied weight once)."""
    return {n: [int(s) for s in p.shape] for n, p in model.named_parameters()}


def first_difference(model_shapes_: dict[str, list[int]], expected: dict) -> str | None:
    """What first differs between a model's ``{fqn: shape}`` and a fingerprint
    (:func:`fingerprint`), or None when they match."""
    have = {(p, tuple(s)): n for p, s, n in table_of(model_shapes_)}
    want = {(str(p), tuple(int(x) for x in s)): int(n) for p, s, n in expected["table"]}
    want_names = {p for p, _ in want}
    have_names = {p for p, _ in have}
    for p, s in sorted(want):
        if p not in have_names:
            return f"the plan's parameter {p} (shape {list(s)}) is not in the model"
    for p, s in sorted(have):
        if p not in want_names:
            return f"the model's parameter {p} (shape {list(s)}) is not in the plan"
    for key in sorted(set(want) | set(have)):
        if want.get(key) != have.get(key):
            p, s = key
            plan_shapes = sorted(list(t) for q, t in want if q == p)
            model_sh = sorted(list(t) for q, t in have if q == p)
            if plan_shapes != model_sh:
                return f"{p} has shape {model_sh[0] if len(model_sh) == 1 else model_sh} in " \
                       f"the model, {plan_shapes[0] if len(plan_shapes) == 1 else plan_shapes} " \
                       "in the plan"
            return (f"{p} {list(s)}: the model has {have.get(key, 0)}, the plan "
                    f"{want.get(key, 0)} (another number of layers or experts)")
    if _digest([[f, s] for f, s in model_shapes_.items()]) != expected["params"]:
        return "the parameter names differ from the plan's (same patterns, other indices)"
    return None


def check_model(model, expected: dict) -> None:
    """:class:`ModelMismatch` unless ``model``'s parameters are those of the fingerprint
    ``expected`` (plan.json ``model.fingerprint``)."""
    why = first_difference(model_shapes(model), expected)
    if why is not None:
        raise ModelMismatch(f"the model does not match the plan: {why}")
