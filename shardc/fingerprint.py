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

After placing, :func:`check_placed` compares every parameter the plan splits (a ``Shard``
in its params row) with the local shape the row says (:func:`placed_table`, emitted into the
file as ``PLACED``) and raises :class:`NotPlaced` (a :class:`ModelMismatch`) naming the first
one left whole or cut otherwise: a model whose names and shapes match but whose class or
forward path keeps a weight from being replaced.
"""

from __future__ import annotations

_DIGEST_MODULUS = (1 << 127) - 1  # a Mersenne prime: digests are 32 hex digits


class ModelMismatch(ValueError):
    """The model is not the one the plan was made for (the message names the first
    difference)."""


class NotPlaced(ModelMismatch):
    """After placement a parameter the plan splits does not have the local shape its params
    row says (the message names the first)."""


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


def fused_views(shapes: dict[str, list[int]], expected: dict) -> dict[str, list[int]]:
    """``shapes`` with each parameter stored fused -- ``[E * f, h]`` where the plan's table
    lists its pattern at the ``[E, f, h]`` view (DBRX's experts,
    :mod:`shardc.frontends.fused_experts`; the same elements) -- at that view."""
    views: dict[str, list[list[int]]] = {}
    for p, s, _ in expected.get("table", []):
        if len(s) == 3:
            views.setdefault(str(p), []).append([int(x) for x in s])
    out = {}
    for fqn, shape in shapes.items():
        for view in views.get(name_pattern(fqn), ()):
            if len(shape) == 2 and shape == [view[0] * view[1], view[2]]:
                shape = view
                break
        out[fqn] = shape
    return out


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
    why = first_difference(fused_views(model_shapes(model), expected), expected)
    if why is not None:
        raise ModelMismatch(f"the model does not match the plan: {why}")


def placed_table(rows: list[dict], dims: list[str]) -> dict:
    """What :func:`check_placed` compares: ``{"dims": dims, "patterns": {pattern: [shape,
    placements, local_shape]}, "names": {fqn: [...]}}`` of the params rows with a ``Shard``;
    a name pattern whose rows all agree (every layer's ``q_proj``) is one entry, the rows
    of a pattern placed differently in different layers are listed by name (a pattern with
    a row left whole is listed by name too: its other names are unsplit). ``dims``: the
    SPMD mesh dims the rows' placements lists refer to (plan.json ``spmd_dims``)."""
    by_pattern: dict[str, list] = {}
    for r in rows:
        entry = [[int(s) for s in r["shape"]], [str(p) for p in r["placements"]],
                 [int(s) for s in r["local_shape"]]]
        by_pattern.setdefault(name_pattern(str(r["fqn"])), []).append((str(r["fqn"]), entry))
    patterns, names = {}, {}
    for pattern, items in sorted(by_pattern.items()):
        split = [(f, e) for f, e in items if any(p.startswith("S(") for p in e[1])]
        if not split:
            continue
        if len(split) == len(items) and all(e == split[0][1] for _, e in split):
            patterns[pattern] = split[0][1]
        else:
            names.update(dict(split))
    return {"dims": [str(d) for d in dims], "patterns": patterns, "names": names}


def _local_sizes(size: int, ways: int, coordinate) -> set[int]:
    """A dim of ``size`` cut ``ways`` ways as DTensor's ``Shard`` cuts it (``torch.chunk``:
    ceil-sized pieces, the last ones shorter or empty): the piece of rank ``coordinate`` on
    that mesh dim, or every piece's size when it is unknown (None)."""
    piece = -(-size // ways)
    coords = range(ways) if coordinate is None else (coordinate,)
    return {max(0, min(piece, size - c * piece)) for c in coords}


def _mesh_coordinates(mesh, dims: list[str]) -> dict:
    """``{dim: (size, this rank's coordinate or None)}`` of ``mesh``'s dims named ``dims``
    (a mesh without such names: sizes and coordinates unknown, None)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    out = {}
    for d in dims:
        if d in names:
            out[d] = (int(mesh.size(names.index(d))), int(mesh.get_local_rank(d)))
        else:
            out[d] = (None, None)
    return out


def check_placed(model, placed: dict, mesh=None) -> None:
    """:class:`NotPlaced` unless every parameter of ``model`` (after placement) that
    ``placed`` (:func:`placed_table`) splits has the local shape its row says: the row's
    ``local_shape``, or on an uneven cut this rank's piece (:func:`_local_sizes`).
    ``mesh``: the world mesh (its coordinates say which piece this rank holds). Parameters
    another pipeline stage holds are not in ``model`` and are not checked."""
    dims = placed["dims"]  # the SPMD mesh dims each row's placements list refers to
    coords = _mesh_coordinates(mesh, dims)
    for fqn, param in model.named_parameters():
        entry = placed["names"].get(fqn) or placed["patterns"].get(name_pattern(fqn))
        if entry is None:  # replicated by the plan, or not the plan's parameter
            continue
        shape, placements, local = entry
        have = [int(s) for s in getattr(param, "to_local", lambda: param)().shape]
        ok = have == local
        if not ok and len(have) == len(shape):  # an uneven cut: this rank's piece
            want = [{s} for s in shape]
            for d, p in zip(dims, placements):
                if p.startswith("S("):
                    k = int(p[2:-1])
                    ways, coord = coords.get(d, (None, None))
                    if ways is None:  # no mesh to read: any piece of a cut of the row's size
                        ways = max(1, -(-shape[k] // max(local[k], 1)))
                    want[k] = {n for s in want[k] for n in _local_sizes(s, ways, coord)}
            ok = all(h in w for h, w in zip(have, want))
        if not ok:
            how = "was left whole" if have == shape else "was cut otherwise"
            raise NotPlaced(f"the plan was not applied: {fqn} {how} (local shape {have} on "
                            f"this rank; the plan's params row says {local}, {shape} placed "
                            f"{' '.join(placements)} over {' x '.join(dims)}); its module's "
                            "class or forward path is not the one the plan was made for")
