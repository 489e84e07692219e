"""``shardc verify MODEL --plan plan.json [--world N]``: run a plan for real and check it.

Spawns N gloo processes on loopback, shards the model file's ``tiny_model()`` by running the
``parallelize.py`` of the plan scaled to the tiny model (:func:`tiny_plan`: the file
``Plan.code`` emits and ``Plan.apply`` runs, the same choices) and compares the logits with
the unsharded model. An HF ``config.json`` gets a tiny variant derived from it
(:func:`shardc.frontends.tiny_config.tiny_config`) whose shapes the plan's degrees, capped at
``gcd(degree, N)``, divide; its layers are mapped onto the plan's layer kinds through the
original layers they play. A plan made for a bigger mesh keeps its per-op choices and has its
degrees scaled down to fit N ranks and the tiny model's shapes; what was scaled is printed.
Exit 0 when the logits match within ``--tol`` (relative to the largest logit), 1 when they do
not or cannot be compared (NaN / Inf on either side, a rank failed): one line on stdout
saying by how much or what failed; 2 for bad input, a model other than the plan's, or one
whose ranks' placement left a parameter the plan splits whole (named).
"""

from __future__ import annotations

import itertools
import math
import sys

from shardc.text import one_line
from shardc.validate import ascii_float, ascii_int

MAX_WORLD = 64  # local gloo processes one verify starts (each builds the tiny model)
MAX_SEQ = 4096  # tokens per sequence of the check's batch

HELP = ("Run plan.json on N local gloo processes with the model's tiny variant and compare "
        "logits.")


def add_arguments(p) -> None:
    p.add_argument("model", help="model file (.py) providing tiny_model() or a small "
                   "build_model(), or an HF config.json (a tiny variant is derived from it)")
    p.add_argument("--plan", required=True, help="plan.json written by shardc compile")
    p.add_argument("--world", type=ascii_int, default=4,
                   help=f"number of local processes (default 4, at most {MAX_WORLD})")
    p.add_argument("--tol", type=ascii_float, default=1e-4,
                   help="max relative error, finite and > 0 (default 1e-4)")
    p.add_argument("--seq", type=ascii_int, default=8,
                   help=f"tokens per sequence (default 8, at most {MAX_SEQ})")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fit_problem(graph, strategy, layer_kinds) -> str | None:
    """Why ``strategy`` cannot shard the model of ``graph`` (its tiny variant, traced; None
    if it can): the tensor dims its parameters' placements cut (plan.json params rows from
    the IR) must divide by the degree, packed parts by tp, heads by tp for a heads split,
    layers by pp."""
    from shardc.backends.layout import param_plan

    deg = strategy.degrees
    kind_of = {i: k for k, ls in layer_kinds.items() for i in ls}
    dims = deg.spmd_dims()
    for r in param_plan(graph, strategy, kind_of):
        fqn, shape = r["fqn"], tuple(r["shape"])
        for dim, spell in zip(r.get("mesh_dims") or dims, r["placements"]):
            n = getattr(deg, dim)
            if spell.startswith("S(") and shape[int(spell[2:-1])] % n:
                return f"{fqn} {shape} does not split {n} ways ({dim})"
            if dim in ("tp", "moe_tp") and spell.startswith("S(") and \
                    any(w % n for w in r.get("parts", ())):
                return f"{fqn} {shape}: packed parts {r['parts']} do not split {n} ways"
        if deg.experts_resplit and r.get("expert_dim") is not None \
                and "mesh_dims" not in r:  # cut over ep x tp at once
            n = deg.tp * deg.ep
            cut = r["placements"][0]
            if cut.startswith("S(") and (shape[int(cut[2:-1])] % n
                                         or any(w % n for w in r.get("parts", ()))):
                return f"{fqn} {shape} does not split {n} ways (the experts' ep x tp)"
    if deg.pp > graph.num_layers:
        return f"pp={deg.pp} > {graph.num_layers} layers"
    for k in graph.layer_kinds:
        core = k.op("attn_core")
        heads = (int(core.attrs.get("heads", 0)), int(core.attrs.get("kv_heads", 0))) \
            if core is not None else (0, 0)
        for i in k.layers:
            if deg.tp > 1 and strategy.choices.get(f"{kind_of.get(i)}.attn_core", 2) == 0 \
                    and (heads[0] % deg.tp or heads[1] % deg.tp):
                return f"tp={deg.tp} does not divide {heads[0]} heads / {heads[1]} KV heads"
    return None


def fit_degrees(graph, strategy, layer_kinds, world: int):
    """Largest degrees dividing the plan's (same choices) that fit ``world`` ranks and the
    model; dp then fills the remaining ranks. Returns (strategy, notes)."""
    from shardc.ir.strategy import Degrees, Strategy

    d0 = strategy.degrees
    names = ("tp", "ep", "pp", "dp")
    best, best_key = None, None
    for combo in itertools.product(*[_divisors(getattr(d0, n)) for n in names]):
        deg = dict(zip(names, combo))
        prod = deg["tp"] * deg["ep"] * deg["pp"] * deg["dp"]
        if prod > world or world % prod:
            continue
        split = _scaled_split(d0, deg["tp"], deg["ep"])
        if split is None:
            continue  # a mixed split has no mixed counterpart on so few ranks
        cand = Strategy(Degrees(**deg, sp=deg["tp"] if d0.sp > 1 else 1, **split),
                        strategy.batch, dict(strategy.choices))
        if d0.experts_resplit and not cand.degrees.experts_resplit:
            continue  # the experts' own split would become the default: another strategy
        if fit_problem(graph, cand, layer_kinds) is not None:
            continue
        kept = sum(1 for n in names if getattr(d0, n) > 1 and deg[n] > 1)
        key = (prod, kept, deg["tp"], deg["ep"], deg["pp"], deg["dp"])
        if best_key is None or key > best_key:
            best, best_key = cand, key
    if best is None:
        from shardc.errors import InputError

        raise InputError(f"no scaled-down degrees of {d0.as_dict()} fit {world} ranks and the model")
    deg = best.degrees
    if deg.world < world:
        deg = Degrees(tp=deg.tp, ep=deg.ep, pp=deg.pp, dp=deg.dp * (world // deg.world), sp=deg.sp,
                      moe_tp=deg.moe_tp, moe_ep=deg.moe_ep)
        best = Strategy(deg, best.batch, best.choices)
    notes = [f"{n} {getattr(d0, n)}->{getattr(deg, n)}"
             for n in ("tp", "ep", "pp", "dp", "sp", "moe_tp", "moe_ep")
             if getattr(d0, n) != getattr(deg, n)]
    return best, notes


def _dense_or_moe(graph) -> dict[int, str]:
    """Tiny layer -> ``moe_block`` (it has experts) or ``dense_block``, from its graph."""
    return {i: "moe_block" if k.op("expert_ffn1") is not None else "dense_block"
            for k in graph.layer_kinds for i in k.layers}


def _tiny_layer_kinds(graph, model, plan) -> dict[str, list[int]]:
    from shardc.errors import InputError

    source = _source_kinds(graph, model, plan)
    if source is not None:
        return source
    inferred = _dense_or_moe(graph)
    names = [k["name"] for k in plan.layer_kinds]
    kinds: dict[str, list[int]] = {}
    for i, k in inferred.items():
        if k not in names:
            if len(names) != 1 or k not in names[0]:  # dense vs MoE never mix
                raise InputError(f"plan layer kinds {names} do not match the tiny model's "
                                 f"layers ({sorted(set(inferred.values()))})")
            k = names[0]
        kinds.setdefault(k, []).append(i)
    return kinds


def _source_kinds(graph, model, plan) -> dict[str, list[int]] | None:
    """Kind -> tiny layers when the tiny model records which original layer each of its layers
    plays (``config.shardc_source_layers``, set by tiny_config) and the plan lists its kinds'
    layers: tiny layer i gets the plan kind of original layer ``source[i]``. Refused (one
    line) when that kind is dense and the tiny layer has experts, or the other way round."""
    from shardc.errors import InputError

    source = getattr(getattr(model, "config", None), "shardc_source_layers", None)
    if not source or not all(k.get("layers") for k in plan.layer_kinds):
        return None
    plan_kind = {i: k["name"] for k in plan.layer_kinds for i in k["layers"]}
    inferred = _dense_or_moe(graph)
    kinds: dict[str, list[int]] = {}
    for i, orig in enumerate(source):
        name = plan_kind.get(orig)
        # the plan's kind names the block (``moe_block``, ``linear_attn_moe_block``,
        # ``mamba2_dense_block``, ``dense_block_2``): dense vs MoE must agree
        if name is None or inferred[i] not in name:
            raise InputError(f"plan layer kinds {[k['name'] for k in plan.layer_kinds]} do not "
                             f"match the tiny model's layers: its layer {i} (original layer "
                             f"{orig}) is a {inferred[i]}, the plan's layer {orig} is "
                             f"{name or 'missing'}")
        kinds.setdefault(name, []).append(i)
    return kinds


def _check_args(args) -> None:
    """The flags' bounds again (the command's ``run`` may be called without the parser)."""
    from shardc.errors import InputError
    from shardc.validate import check_number

    if isinstance(args.world, bool) or not isinstance(args.world, int) or args.world < 1:
        raise InputError("--world must be a positive number of processes")
    check_number(args.world, "--world", integer=True, minimum=1, maximum=MAX_WORLD,
                 unit="processes")
    if not (isinstance(args.tol, (int, float)) and math.isfinite(args.tol) and args.tol > 0):
        raise InputError(f"--tol {args.tol}: expected a finite positive number (max relative "
                         "error, e.g. 1e-4)")
    if isinstance(args.seq, bool) or not isinstance(args.seq, int) or args.seq < 1:
        raise InputError(f"--seq {args.seq}: expected a positive number of tokens per sequence")
    check_number(args.seq, "--seq", integer=True, minimum=1, maximum=MAX_SEQ, unit="tokens")


def _scaled_split(d0, tp: int, ep: int) -> dict[str, int] | None:
    """The experts split of the plan's degrees ``d0`` at the scaled ``tp`` x ``ep``: the same
    kind (all-TP: moe_tp = tp x ep; all-EP: moe_ep = tp x ep; mixed: both > 1, moe_tp the
    largest divisor of tp x ep up to the plan's that leaves moe_ep > 1, None when there is
    none); empty for the default split."""
    if not d0.experts_resplit:
        return {}
    group = tp * ep
    if d0.moe_ep == 1:
        return {"moe_tp": group, "moe_ep": 1}
    if d0.moe_tp == 1:
        return {"moe_tp": 1, "moe_ep": group}
    mixed = [m for m in range(2, min(d0.moe_tp, group // 2) + 1) if group % m == 0]
    return {"moe_tp": mixed[-1], "moe_ep": group // mixed[-1]} if mixed else None


def _degree_caps(strategy, world: int) -> dict[str, int]:
    """Per degree, the largest value ``fit_degrees`` can pick: it divides both the plan's
    degree and ``world`` (the scaled degrees' product divides ``world``)."""
    deg = strategy.degrees
    return {n: math.gcd(getattr(deg, n), world) for n in ("tp", "ep", "pp", "dp")}


def _roles(rows, layers=None) -> dict:
    """``{layer or None: {(name pattern, op)}}`` of params rows (layer and expert indices
    written ``*``: what survives scaling a model down to its tiny variant)."""
    from shardc.fingerprint import name_pattern

    out: dict = {}
    for r in rows:
        layer = r.get("layer")
        if layers is None or layer in layers or layer is None:
            out.setdefault(layer, set()).add((name_pattern(str(r["fqn"])), r.get("op")))
    return out


def check_tiny_matches(plan, graph, strategy, layer_kinds, model) -> None:
    """InputError naming the first difference unless the tiny model has the plan's
    parameters by name pattern and role (:func:`_roles`): globally, and each tiny layer
    against the plan's layer it plays (``config.shardc_source_layers``, else the first plan
    layer of its kind). The plan's own rows are compared, not rows rebuilt from the tiny
    model, so a hand-edited row (deleted, moved, another op) or another model is refused."""
    from shardc.backends.layout import param_plan
    from shardc.errors import InputError
    from shardc.ir.strategy import Degrees, Strategy

    kind_of = {i: k for k, ls in layer_kinds.items() for i in ls}
    unsharded = Strategy(Degrees(tp=1, pp=1, ep=1, dp=1), 1, dict(strategy.choices))
    tiny = _roles(param_plan(graph, unsharded, kind_of))  # roles do not depend on degrees
    planned = _roles(plan.params)
    source = getattr(getattr(model, "config", None), "shardc_source_layers", None)
    first_of_kind = {k["name"]: k["layers"][0] for k in plan.layer_kinds if k.get("layers")}

    def differ(where: str, want: set, have: set) -> None:
        for pattern, op in sorted(want - have, key=str):
            raise InputError(f"the model does not match the plan: {where}the plan's parameter "
                             f"{pattern} ({op or 'no fused op'}) is not in the model")
        for pattern, op in sorted(have - want, key=str):
            raise InputError(f"the model does not match the plan: {where}the model's parameter "
                             f"{pattern} ({op or 'no fused op'}) is not in the plan")

    differ("", planned.get(None, set()), tiny.get(None, set()))
    for i in sorted(k for k in tiny if k is not None):
        orig = source[i] if source and i < len(source) else first_of_kind.get(kind_of.get(i))
        differ(f"layer {i} (the plan's layer {orig}): ", planned.get(orig, set()), tiny[i])


def tiny_plan(plan, graph, strategy, layer_kinds):
    """``plan`` for the tiny model of ``graph`` at the scaled ``strategy``: the same choices,
    the scaled degrees and mesh, the tiny layers under the plan's layer kinds and the tiny
    model's params rows (IR roles, :func:`shardc.backends.layout.param_plan`)."""
    from dataclasses import replace

    from shardc.backends.layout import param_plan
    from shardc.fingerprint import fingerprint

    deg = strategy.degrees
    shape, names = deg.logical_mesh()
    kind_of = {i: k for k, ls in layer_kinds.items() for i in ls}
    rows = param_plan(graph, strategy, kind_of)
    return replace(plan, degrees=dict(deg.as_dict()),
                   logical_mesh={"shape": list(shape), "dim_names": list(names)},
                   spmd_dims=deg.spmd_dims(),
                   mesh={**plan.mesh, "gpus_per_node": deg.world, "nodes": 1},
                   model={**plan.model, "layers": graph.num_layers,
                          "fingerprint": fingerprint(rows)},
                   layer_kinds=[{"name": k, "count": len(ls), "layers": list(ls)}
                                for k, ls in layer_kinds.items()],
                   params=rows, nodes=[])


def pool_plans(plan) -> list[tuple[str | None, object]]:
    """``[(pool role, its plan)]`` to check: every pool of a disaggregated plan (plan.json
    ``serving.pools``: the top level is the decode pool's plan; each pool has its own degrees,
    batch and per-op choices, checked against the top level's ops: InputError otherwise),
    else ``[(None, plan)]`` (one plan, an aggregated pool's too)."""
    from dataclasses import replace

    from shardc.errors import InputError
    from shardc.ir.contract import CHOICE_NAMES

    sv = plan.serving or {}
    if sv.get("mode") != "disagg" or not sv.get("pools"):
        return [(None, plan)]
    kind_of = {o["name"]: o["kind"] for o in plan.ops}
    out = []
    for pool in sv["pools"]:
        where = f"plan.json: serving: pool {one_line(pool['role'])!r}"
        ops = []
        for o in pool["ops"]:
            kind = kind_of.get(o["name"])
            if kind is None or o["choice"] not in CHOICE_NAMES[kind]:
                raise InputError(f"{where}: op {one_line(o['name'])!r} choice "
                                 f"{one_line(o['choice'])!r} is not one of the plan's ops' "
                                 "choices")
            ops.append({"name": o["name"], "kind": kind, "choice": o["choice"]})
        if sorted(o["name"] for o in ops) != sorted(kind_of):
            raise InputError(f"{where}: its ops are not the plan's ({len(ops)} entries for "
                             f"{len(kind_of)} ops)")
        out.append((str(pool["role"]), replace(
            plan, degrees=dict(pool["degrees"]), ops=ops,
            workload={**plan.workload, "batch": int(pool.get("batch") or 1)})))
    return out


def _pool_case(label, pool_plan, graph, model, kinds, args, problem):
    """(the :class:`~shardc.backends.verify.Case` running ``pool_plan`` scaled to the tiny
    model on ``args.world`` ranks, its degrees); prints what was scaled."""
    from dataclasses import replace

    from shardc.backends.support import family_name, refusal, torch_style_verdict
    from shardc.backends.verify import Case
    from shardc.errors import InputError

    what = f"the {label} pool's" if label else "the plan's"
    check_tiny_matches(pool_plan, graph, pool_plan.strategy(), kinds, model)
    strategy, notes = fit_degrees(graph, pool_plan.strategy(), kinds, args.world)
    deg = strategy.degrees
    scaled = replace(tiny_plan(pool_plan, graph, strategy, kinds), backend={})
    if problem:  # the first runtime cannot: the torch-style one must (as compile decides)
        verdict = torch_style_verdict({"runs": False,
                                       "reason": refusal(family_name(model), problem)},
                                      [scaled], graph)
        if not verdict["runs"]:  # a model no parallelize.py can run: exit 2
            raise InputError(f"{args.model}: {verdict['reason']}; no parallelize.py would work")
    if notes:
        print(f"scaled {what} degrees to fit {args.world} ranks and the tiny model: "
              + ", ".join(notes) + " (per-op choices kept)")
    # the scaled plan's own parallelize.py, the file Plan.apply runs (same choices)
    return Case(label or "plan", deg.as_dict(), {}, kinds, code_text=scaled.code()), deg


def run(args) -> int:
    from shardc.backends.support import backend_problem
    from shardc.backends.verify import run_cases
    from shardc.errors import InputError
    from shardc.frontends import graph_from_module
    from shardc.frontends.model_file import load_model_file
    from shardc.plan import load_plan

    _check_args(args)
    plan = load_plan(args.plan)
    from shardc.backends.support import experts_split_problem

    pools = pool_plans(plan)
    for label, pool_plan in pools:
        split = experts_split_problem(pool_plan.strategy().degrees)
        if split:  # the runtime would run the default split: a different strategy
            where = f" ({label} pool)" if label else ""
            raise InputError(f"{args.plan}{where}: {split}; nothing to verify against")
    caps = {}  # per degree the largest any pool can use (the tiny model is built once)
    for _, p in pools:
        for k, v in _degree_caps(p.strategy(), args.world).items():
            caps[k] = math.lcm(caps.get(k, 1), v)
    src = load_model_file(args.model, tiny_degrees=caps)
    model, inputs = src.build(tiny=True)
    source = getattr(getattr(model, "config", None), "shardc_source_layers", None)
    if source and args.model.endswith(".json"):
        params = sum(p.numel() for p in model.parameters())
        print(f"tiny variant of {args.model}: {type(model).__name__} with the original layers "
              f"{source}, {params / 1e6:.2f}M parameters (float32, CPU)")
    problem = backend_problem(model)
    graph = graph_from_module(model, inputs, name=src.name)
    kinds = _tiny_layer_kinds(graph, model, plan)
    cases, degs = [], []
    for label, pool_plan in pools:
        case, deg = _pool_case(label, pool_plan, graph, model, kinds, args, problem)
        cases.append(case)
        degs.append(deg)
    # a config.json's tiny model depends on the degree caps: the workers build the same one
    extra = {"tiny_degrees": caps} if args.model.endswith(".json") else {}
    results = run_cases(args.model, cases, args.world, seq=args.seq, **extra)
    failed = 0
    for (label, _), deg, res in zip(pools, degs, results):
        where = (f"{label} pool, " if label else "") + f"{src.name} on {deg.world} gloo ranks " \
            f"({' '.join(f'{k}={v}' for k, v in deg.as_dict().items())})"
        if res.get("refused"):  # a parameter the plan splits was left whole: exit 2, named
            raise InputError(res["refused"].splitlines()[0])
        if res["error"]:
            sys.stdout.write(f"verify FAILED: {where}: {res['error'].splitlines()[0]}\n")
            failed += 1
        elif not math.isfinite(res["rel_err"]) or res["rel_err"] > args.tol:
            sys.stdout.write(f"verify MISMATCH: {where}: max relative error "
                             f"{res['rel_err']:.3g} > {args.tol:g}\n")
            failed += 1
        else:
            print(f"verify OK: {where}: max relative error {res['rel_err']:.3g} <= {args.tol:g}")
    if len(pools) > 1:
        names = ", ".join(label for label, _ in pools)
        print(f"checked every pool of the disaggregated plan ({names}): "
              + (f"{failed} of {len(pools)} failed" if failed else "all match"))
    return 1 if failed else 0
