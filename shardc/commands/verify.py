"""``shardc verify MODEL --plan plan.json [--world N]``: run a plan for real and check it.

Spawns N gloo processes on loopback, shards the model file's ``tiny_model()`` with the plan's
per-op choices (the same runtime as ``parallelize.py``) and compares the logits with the
unsharded model. An HF ``config.json`` gets a tiny variant derived from it
(:func:`shardc.frontends.tiny_config.tiny_config`) whose shapes the plan's degrees, capped at
``gcd(degree, N)``, divide; its layers are mapped onto the plan's layer kinds through the
original layers they play. A plan made for a bigger mesh keeps its per-op choices and has its
degrees scaled down to fit N ranks and the tiny model's shapes; what was scaled is printed.
Exit 0 when the logits match within ``--tol`` (relative to the largest logit), 1 when they do
not or cannot be compared (NaN / Inf on either side, a rank failed): one line on stdout
saying by how much or what failed; 2 for bad input.
"""

from __future__ import annotations

import itertools
import math
import sys

HELP = ("Run plan.json on N local gloo processes with the model's tiny variant and compare "
        "logits.")


def add_arguments(p) -> None:
    p.add_argument("model", help="model file (.py) providing tiny_model() or a small "
                   "build_model(), or an HF config.json (a tiny variant is derived from it)")
    p.add_argument("--plan", required=True, help="plan.json written by shardc compile")
    p.add_argument("--world", type=int, default=4, help="number of local processes (default 4)")
    p.add_argument("--tol", type=float, default=1e-4, help="max relative error, finite and > 0 (default 1e-4)")
    p.add_argument("--seq", type=int, default=8, help="tokens per sequence (default 8)")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fit_problem(model, strategy, layer_kinds) -> str | None:
    """Why ``strategy`` cannot shard ``model`` (None if it can): shapes the degrees must
    divide, heads for a heads split, experts for ep, layers for pp."""
    from shardc.backends.layout import param_placements, param_role
    from shardc.backends.models import adapter_for

    deg = strategy.degrees
    kind_of = {i: k for k, ls in layer_kinds.items() for i in ls}
    for fqn, p in model.named_parameters():
        pl = param_placements(fqn, p.ndim, strategy, kind_of)
        role = param_role(fqn)
        if role is not None and role.fused > 1 and deg.tp > 1:
            if p.shape[role.dims[0]] % (role.fused * deg.tp):
                return f"{fqn} {tuple(p.shape)}: packed parts do not split {deg.tp} ways"
        for dim, spell in zip([d for d in ("dp", "ep", "tp") if getattr(deg, d) > 1], pl):
            if spell.startswith("S(") and p.shape[int(spell[2:-1])] % getattr(deg, dim):
                return f"{fqn} {tuple(p.shape)} does not split {getattr(deg, dim)} ways ({dim})"
    ad = adapter_for(model)
    if deg.pp > ad.num_layers:
        return f"pp={deg.pp} > {ad.num_layers} layers"
    for i in range(ad.num_layers):
        site = ad.layer(i)
        kind = kind_of.get(i)
        if deg.tp > 1 and strategy.choices.get(f"{kind}.attn_core", 2) == 0:
            a = site.attention
            if a.heads % deg.tp or a.kv_heads % deg.tp:
                return f"tp={deg.tp} does not divide {a.heads} heads / {a.kv_heads} KV heads"
        if site.moe is not None and site.moe.num_experts % deg.ep:
            return f"ep={deg.ep} does not divide {site.moe.num_experts} experts"
    return None


def fit_degrees(model, strategy, layer_kinds, world: int):
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
        cand = Strategy(Degrees(**deg, sp=deg["tp"] if d0.sp > 1 else 1), strategy.batch,
                        dict(strategy.choices))
        if fit_problem(model, cand, layer_kinds) is not None:
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
        deg = Degrees(tp=deg.tp, ep=deg.ep, pp=deg.pp, dp=deg.dp * (world // deg.world), sp=deg.sp)
        best = Strategy(deg, best.batch, best.choices)
    notes = [f"{n} {getattr(d0, n)}->{getattr(deg, n)}" for n in ("tp", "ep", "pp", "dp", "sp")
             if getattr(d0, n) != getattr(deg, n)]
    return best, notes


def _tiny_layer_kinds(model, plan) -> dict[str, list[int]]:
    from shardc.backends.models import default_layer_kinds
    from shardc.errors import InputError

    source = _source_kinds(model, plan)
    if source is not None:
        return source
    inferred = default_layer_kinds(model)
    names = [k["name"] for k in plan.layer_kinds]
    kinds: dict[str, list[int]] = {}
    for i, k in inferred.items():
        if k not in names:
            if len(names) != 1 or not names[0].startswith(k):  # dense vs MoE never mix
                raise InputError(f"plan layer kinds {names} do not match the tiny model's "
                                 f"layers ({sorted(set(inferred.values()))})")
            k = names[0]
        kinds.setdefault(k, []).append(i)
    return kinds


def _source_kinds(model, plan) -> dict[str, list[int]] | None:
    """Kind -> tiny layers when the tiny model records which original layer each of its layers
    plays (``config.shardc_source_layers``, set by tiny_config) and the plan lists its kinds'
    layers: tiny layer i gets the plan kind of original layer ``source[i]``. Refused (one
    line) when that kind is dense and the tiny layer has experts, or the other way round."""
    from shardc.backends.models import default_layer_kinds
    from shardc.errors import InputError

    source = getattr(getattr(model, "config", None), "shardc_source_layers", None)
    if not source or not all(k.get("layers") for k in plan.layer_kinds):
        return None
    plan_kind = {i: k["name"] for k in plan.layer_kinds for i in k["layers"]}
    inferred = default_layer_kinds(model)
    kinds: dict[str, list[int]] = {}
    for i, orig in enumerate(source):
        name = plan_kind.get(orig)
        if name is None or not name.startswith(inferred[i]):
            raise InputError(f"plan layer kinds {[k['name'] for k in plan.layer_kinds]} do not "
                             f"match the tiny model's layers: its layer {i} (original layer "
                             f"{orig}) is a {inferred[i]}, the plan's layer {orig} is "
                             f"{name or 'missing'}")
        kinds.setdefault(name, []).append(i)
    return kinds


def _check_args(args) -> None:
    from shardc.errors import InputError

    if args.world < 1:
        raise InputError("--world must be a positive number of processes")
    if not (math.isfinite(args.tol) and args.tol > 0):
        raise InputError(f"--tol {args.tol}: expected a finite positive number (max relative "
                         "error, e.g. 1e-4)")
    if args.seq < 1:
        raise InputError(f"--seq {args.seq}: expected a positive number of tokens per sequence")


def _degree_caps(strategy, world: int) -> dict[str, int]:
    """Per degree, the largest value ``fit_degrees`` can pick: it divides both the plan's
    degree and ``world`` (the scaled degrees' product divides ``world``)."""
    deg = strategy.degrees
    return {n: math.gcd(getattr(deg, n), world) for n in ("tp", "ep", "pp", "dp")}


def run(args) -> int:
    from shardc.backends.verify import Case, run_cases
    from shardc.frontends.model_file import load_model_file
    from shardc.ir.contract import choice_name
    from shardc.plan import load_plan

    _check_args(args)
    plan = load_plan(args.plan)
    caps = _degree_caps(plan.strategy(), args.world)
    src = load_model_file(args.model, tiny_degrees=caps)
    model, _ = src.build(tiny=True)
    source = getattr(getattr(model, "config", None), "shardc_source_layers", None)
    if source and args.model.endswith(".json"):
        params = sum(p.numel() for p in model.parameters())
        print(f"tiny variant of {args.model}: {type(model).__name__} with the original layers "
              f"{source}, {params / 1e6:.2f}M parameters (float32, CPU)")
    kinds = _tiny_layer_kinds(model, plan)
    strategy, notes = fit_degrees(model, plan.strategy(), kinds, args.world)
    deg = strategy.degrees
    if notes:
        print(f"scaled the plan's degrees to fit {args.world} ranks and the tiny model: "
              + ", ".join(notes) + " (per-op choices kept)")
    choices = {k: choice_name(k.split(".")[-1], v) for k, v in strategy.choices.items()}
    case = Case("plan", {k: getattr(deg, k) for k in ("tp", "pp", "ep", "dp", "sp")}, choices,
                kinds)
    # a config.json's tiny model depends on the degree caps: the workers build the same one
    extra = {"tiny_degrees": caps} if args.model.endswith(".json") else {}
    res = run_cases(args.model, [case], deg.world, seq=args.seq, **extra)[0]
    where = f"{src.name} on {deg.world} gloo ranks ({' '.join(f'{k}={v}' for k, v in deg.as_dict().items())})"
    if res["error"]:
        sys.stdout.write(f"verify FAILED: {where}: {res['error'].splitlines()[0]}\n")
        return 1
    if not math.isfinite(res["rel_err"]) or res["rel_err"] > args.tol:
        sys.stdout.write(f"verify MISMATCH: {where}: max relative error {res['rel_err']:.3g} "
                         f"> {args.tol:g}\n")
        return 1
    print(f"verify OK: {where}: max relative error {res['rel_err']:.3g} <= {args.tol:g}")
    return 0
