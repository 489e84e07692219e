"""The checks a plan.json passes before it is used (SPEC section 4): its JSON Schema
(``shardc/schema/plan.schema.json``), then cross-field consistency -- degrees against the
mesh, placements against the spmd dims, layers and stages, params rows against the model's
fingerprint (:mod:`shardc.fingerprint`), serving pools against the GPUs. A hand-edited plan
that fails one is an :class:`~shardc.errors.InputError` naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardc.errors import InputError
from shardc.fingerprint import fingerprint
from shardc.ir.contract import (
    CHOICE_NAMES,
)
from shardc.ir.strategy import Degrees, Mesh, Workload

SCHEMA_PATH = Path(__file__).parent / "schema" / "plan.schema.json"


def validate_plan_dict(data: dict, where: str = "plan") -> None:
    """JSON Schema check, then cross-field consistency (a hand-edited plan)."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    err = jsonschema.exceptions.best_match(_validator(jsonschema)(schema).iter_errors(data))
    if err is not None:
        at = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise InputError(f"{where}: {at}: {err.message}")
    d, m = data["degrees"], data["mesh"]
    w = data["workload"]
    section = "degrees"
    try:  # the same checks (and bounds) as the command line's
        deg = Degrees(tp=d["tp"], pp=d["pp"], ep=d["ep"], dp=d["dp"], sp=d.get("sp", 1),
                      moe_tp=d.get("moe_tp", 0), moe_ep=d.get("moe_ep", 0))
        section = "mesh"
        Mesh(m["gpus_per_node"], m["nodes"])
        section = "workload"
        Workload(phase=w["phase"], batch=w["batch"], context=w["context"], prompt=w["prompt"],
                 tpot_slo_ms=w["tpot_slo_ms"], ttft_slo_ms=w["ttft_slo_ms"],
                 weights=w.get("weights", "bf16"), kv_cache=w.get("kv_cache", "bf16"),
                 **{k: w[k] for k in ("isl", "osl", "mode", "routing", "redundant_experts",
                                      "fp8_scaling") if k in w})
    except InputError as e:
        raise InputError(f"{where}: {section}: {e}") from None
    gpus = m["gpus_per_node"] * m["nodes"]
    serving = data.get("serving") or {}
    if serving:
        _check_serving(serving, deg, gpus, where)
    if deg.world != gpus and not (serving.get("mode") == "disagg" and deg.world <= gpus):
        raise InputError(f"{where}: degrees tp*pp*ep*dp = {deg.world} but the mesh "
                         f"{m['gpus_per_node']}x{m['nodes']} has {gpus} GPUs")
    shape, names = deg.logical_mesh()
    lm = data["logical_mesh"]
    if list(lm["shape"]) != list(shape) or list(lm["dim_names"]) != list(names):
        raise InputError(f"{where}: logical_mesh {lm} does not match the degrees "
                         f"(expected shape {list(shape)}, dim_names {list(names)})")
    kinds = {k["name"] for k in data["layer_kinds"]}
    for o in data["ops"]:
        if o["kind"] not in CHOICE_NAMES:
            raise InputError(f"{where}: ops: unknown op kind {o['kind']!r} in {o['name']!r}")
        if o["choice"] not in CHOICE_NAMES[o["kind"]]:
            raise InputError(f"{where}: ops: {o['name']!r} has unknown choice {o['choice']!r} "
                             f"(expected one of {', '.join(CHOICE_NAMES[o['kind']])})")
        if o.get("layer_kind") is not None and o["layer_kind"] not in kinds:
            raise InputError(f"{where}: ops: {o['name']!r} names layer kind "
                             f"{o['layer_kind']!r}, not in layer_kinds")
    n_dims = len(data["spmd_dims"])
    for n in data["nodes"]:
        if n["placements"] and len(n["placements"]) != n_dims:
            raise InputError(f"{where}: node {n['name']!r} has {len(n['placements'])} "
                             f"placements for {n_dims} mesh dims {data['spmd_dims']}")
    _check_placements(data, deg, where)
    _check_layers(data, deg, where)
    _check_rows(data, where)


def _validator(jsonschema):
    """Draft 2020-12 where an ``integer`` is an integer as JSON writes it (``2``, not ``2.0``:
    a hand-edited ``"tp": 2.0`` is refused, not read as a float degree)."""
    def is_int(checker, value):
        return isinstance(value, int) and not isinstance(value, bool)

    base = jsonschema.Draft202012Validator
    return jsonschema.validators.extend(
        base, type_checker=base.TYPE_CHECKER.redefine("integer", is_int))


def _check_rows(data: dict, where: str) -> None:
    """The params rows are the model's and the ops cover them: no fqn twice, a row's layer
    is the layer its name says, the rows match ``model.fingerprint`` (none deleted, moved or
    given another op; :mod:`shardc.runtime.fingerprint`), and every fused op a row names has
    its ``ops`` entry (an ``"ops": []`` plan would shard nothing)."""
    rows = data["params"]
    seen: set[str] = set()
    for r in rows:
        if r["fqn"] in seen:
            raise InputError(f"{where}: params: {r['fqn']!r} is listed twice")
        seen.add(r["fqn"])
        layer = r.get("layer")
        if layer is not None and str(layer) not in r["fqn"].split("."):
            raise InputError(f"{where}: params: {r['fqn']!r} says layer {layer}; its name "
                             "says otherwise")
    expected = data["model"].get("fingerprint")
    if expected is not None:
        got = fingerprint(rows)
        for key, what in (("params", "names or shapes"), ("roles", "ops or layers"),
                          ("table", "names or shapes")):
            if got[key] != expected[key]:
                raise InputError(f"{where}: params rows do not match model.fingerprint (their "
                                 f"{what} were edited, or a row was deleted or added)")
    kind_of = {i: k["name"] for k in data["layer_kinds"] for i in k["layers"]}
    slots = {o["name"] for o in data["ops"]}
    for r in rows:
        op = r.get("op")
        if op is None or (r.get("layer") is not None and r["layer"] not in kind_of):
            continue
        slot = op if r.get("layer") is None else f"{kind_of[r['layer']]}.{op}"
        if slot not in slots:
            raise InputError(f"{where}: ops: no entry for {slot!r}, the op of parameter "
                             f"{r['fqn']!r}")


def _check_serving(serving: dict, deg: Degrees, gpus: int, where: str) -> None:
    """The pools fit the mesh, their degrees multiply to their workers' GPUs, and the
    top-level degrees are the last pool's (mixed, or decode when disaggregated)."""
    used = 0
    for p in serving["pools"]:
        d = p["degrees"]
        per_worker = d["tp"] * d["ep"] * d["pp"]
        if per_worker != p["gpus_per_worker"] or d["dp"] != p["workers"]:
            raise InputError(f"{where}: serving: pool {p['role']!r} has tp*ep*pp = {per_worker} "
                             f"and dp = {d['dp']} for {p['workers']} workers of "
                             f"{p['gpus_per_worker']} GPUs")
        used += p["workers"] * p["gpus_per_worker"]
    if used > gpus:
        raise InputError(f"{where}: serving: the pools use {used} GPUs; the mesh has {gpus}")
    last = serving["pools"][-1]["degrees"]
    if any(last[k] != getattr(deg, k) for k in ("tp", "ep", "pp", "dp")):
        raise InputError(f"{where}: serving: the top-level degrees are not those of the "
                         f"{serving['pools'][-1]['role']} pool")


def _shard_dim(spelling: str) -> int | None:
    """``"S(3)"`` -> 3; ``"R"``, ``"P(sum)"`` -> None (the schema allows only these forms)."""
    return int(spelling[2:-1]) if spelling.startswith("S(") else None


def _check_placements(data: dict, deg: Degrees, where: str) -> None:
    """``spmd_dims`` match the degrees; every placements list has one entry per SPMD dim and
    shards only dims the tensor has (params and nodes: their shape; ops and collectives: an
    activation [tokens, features])."""
    shape, names = deg.logical_mesh()
    dims = [n for n, size in zip(names, shape) if n != "pp" and size > 1] or ["tp"]
    if list(data["spmd_dims"]) != dims:
        raise InputError(f"{where}: spmd_dims {data['spmd_dims']} do not match the degrees "
                         f"(expected {dims})")

    def check(placements, rank: int, what: str, full: bool = True) -> None:
        if full and len(placements) != len(dims):
            raise InputError(f"{where}: {what} has {len(placements)} placements for "
                             f"{len(dims)} mesh dims {dims}")
        for pl in placements:
            i = _shard_dim(pl)
            if i is not None and i >= rank:
                raise InputError(f"{where}: {what}: placement {pl} shards dim {i} of a "
                                 f"{rank}-dim tensor")

    for o in data["ops"]:
        check(o["placements"], 2, f"op {o['name']!r}")
        check(o.get("input_placements", []), 2, f"op {o['name']!r} input",
              full="input_placements" in o)
        if o["name"].split(".")[-1] != o["kind"]:
            raise InputError(f"{where}: ops: {o['name']!r} is not an op of kind {o['kind']!r}")
    mixed = deg.experts_resplit and deg.moe_tp > 1 and deg.moe_ep > 1
    for p in data["params"]:
        if "mesh_dims" in p:  # the experts mesh of a mixed experts split (moe_ep, moe_tp)
            if not mixed or list(p["mesh_dims"]) != ["moe_ep", "moe_tp"] \
                    or p.get("expert_dim") is None:
                raise InputError(f"{where}: param {p['fqn']!r}: mesh_dims {p['mesh_dims']} "
                                 "(only the expert weights of a split with moe_tp and moe_ep "
                                 "both > 1 have them: ['moe_ep', 'moe_tp'])")
            if len(p["placements"]) != 2:
                raise InputError(f"{where}: param {p['fqn']!r} has {len(p['placements'])} "
                                 "placements for its 2 mesh dims ['moe_ep', 'moe_tp']")
            check(p["placements"], len(p["shape"]), f"param {p['fqn']!r}", full=False)
            continue
        check(p["placements"], len(p["shape"]), f"param {p['fqn']!r}")
    for n in data["nodes"]:
        # node placements follow the annotation's [tokens, features] activation model, so
        # a scalar or 1-dim node may carry S(0) / S(1): at least 2 dims are allowed
        check(n["placements"], max(len(n["shape"]), 2), f"node {n['name']!r}",
              full=bool(n["placements"]))
        red = n.get("redistribute")
        for r in ([red] + list(red.get("also", []))) if red else []:
            check([r["src"], r["dst"]], 2, f"node {n['name']!r} collective", full=False)
            if r["mesh_dim"] not in dims:
                raise InputError(f"{where}: node {n['name']!r}: a collective over mesh dim "
                                 f"{r['mesh_dim']!r}, not one of {dims}")


def _check_layers(data: dict, deg: Degrees, where: str) -> None:
    """Layer indices and counts agree with ``model.layers``; stages exist under ``pp``."""
    n_layers = data["model"]["layers"]
    seen: set[int] = set()
    for k in data["layer_kinds"]:
        if k["count"] != len(k["layers"]):
            raise InputError(f"{where}: layer kind {k['name']!r} has count {k['count']} but "
                             f"lists {len(k['layers'])} layers")
        for i in k["layers"]:
            if i >= n_layers or i in seen:
                raise InputError(f"{where}: layer kind {k['name']!r} lists layer {i}, "
                                 + ("listed twice" if i in seen else
                                    f"but the model has {n_layers} layers (0..{n_layers - 1})"))
            seen.add(i)
    if data["layer_kinds"] and len(seen) != n_layers:
        raise InputError(f"{where}: layer_kinds cover {len(seen)} of the model's {n_layers} "
                         "layers")
    if n_layers and deg.pp > n_layers:
        raise InputError(f"{where}: pp={deg.pp} pipeline stages for {n_layers} layers")
    for what, rows, key in (("node", data["nodes"], "name"), ("param", data["params"], "fqn")):
        for r in rows:
            layer, stage = r.get("layer"), r.get("stage")
            if layer is not None and not (isinstance(layer, int) and 0 <= layer < n_layers):
                raise InputError(f"{where}: {what} {r[key]!r} is in layer {layer!r}; the model "
                                 f"has {n_layers} layers")
            if stage is not None and not 0 <= stage < deg.pp:
                raise InputError(f"{where}: {what} {r[key]!r} is on stage {stage}; pp={deg.pp}")
