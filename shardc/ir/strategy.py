"""The sharding strategy: the vocabulary shared by the cost model, the search and the backend.

A strategy is (parallel degrees, batch, per-fused-op choices). This module defines

* :class:`Mesh` (the physical cluster ``GxN``) and :class:`Workload`;
* :class:`Degrees` -- tp, pp, ep, dp, sp validated in one place, and the logical mesh
  they imply (dims ordered outermost -> innermost: ``pp, dp, ep, tp``; tp innermost, so a
  tp group of <= G ranks sits inside one NVLink domain);
* the per-op choices (the paper's ``d_l``): index 0 / 1 / 2 = shard the op's weight on
  dim 0 / dim 1 / do not shard, with the activation placements each implies on the tp mesh
  dim (:func:`op_placements`), and the collective that repairs a producer/consumer
  mismatch (:func:`redistribution`).  The annotation pass and the cost model both read
  these tables, so the collectives charged and the collectives emitted cannot drift;
* the branches of a block (:data:`BRANCHES`): each starts from the residual stream and
  must end in the residual-stream placement (``R``, or ``S(0)`` under sequence parallel).

Activation placements on the tp dim, activation = [tokens, features]:
``R`` replicated, ``S(0)`` split over tokens, ``S(1)`` split over features (heads for
attention), ``P`` partial sums (spelt ``P(sum)`` in plan.json).
Over the dp and ep mesh dims activations are always ``S(0)`` (the batch is split); expert
weights are ``S(0)`` over ep (the expert dim); every other weight is ``R`` over dp and ep.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from shardc.errors import InputError
from shardc.validate import (
    MAX_BATCH,
    MAX_GPUS,
    MAX_MS,
    MAX_TOKENS,
    check_number,
    parse_int_text,
)

# ------------------------------------------------------------------------- mesh, workload
_MESH_RE = re.compile(r"^\s*(\d+)x(\d+)\s*$")


@dataclass(frozen=True)
class Mesh:
    """Physical cluster: ``nodes`` nodes of ``gpus_per_node`` GPUs (one NVLink domain each);
    at most :data:`~shardc.validate.MAX_GPUS` GPUs in all."""

    gpus_per_node: int
    nodes: int

    def __post_init__(self):
        for name in ("gpus_per_node", "nodes"):
            check_number(getattr(self, name), f"mesh {name}", integer=True, minimum=1,
                         maximum=MAX_GPUS)
        if self.gpus > MAX_GPUS:
            raise InputError(f"mesh {self}: {self.gpus:,} GPUs is more than shardc plans for "
                             f"(at most {MAX_GPUS:,} GPUs in all)")

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def __str__(self) -> str:
        return f"{self.gpus_per_node}x{self.nodes}"

    @classmethod
    def parse(cls, text: str) -> Mesh:
        m = _MESH_RE.match(str(text))
        g_txt, n_txt = ((x.lstrip("0") or "0") for x in m.groups()) if m else ("0", "0")
        if g_txt == "0" or n_txt == "0":
            raise InputError(
                f"--mesh {str(text)[:40]!r}: expected GxN with positive integers "
                "(G GPUs per node x N nodes), e.g. 8x128"
            )
        if max(len(g_txt), len(n_txt)) > 12 or int(g_txt) * int(n_txt) > MAX_GPUS:
            shown = text.strip() if len(text.strip()) <= 30 else text.strip()[:27] + "..."
            raise InputError(f"--mesh {shown}: more GPUs than shardc plans for "
                             f"(at most {MAX_GPUS:,} GPUs in all)")
        return cls(int(g_txt), int(n_txt))


@dataclass
class Workload:
    """What is served. ``batch`` None means "search it" (``--batch auto``).

    context: KV-cache length in tokens seen by each decode step; prompt: prompt tokens per
    sequence for prefill; SLOs in milliseconds.
    """

    phase: str = "decode"
    batch: int | None = None
    context: int = 4096
    prompt: int = 2048
    tpot_slo_ms: float = 50.0
    ttft_slo_ms: float = 2000.0

    def __post_init__(self):
        if self.phase not in ("decode", "prefill"):
            raise InputError(f"--phase {self.phase!r}: expected decode or prefill")
        for name in ("context", "prompt"):
            setattr(self, name, check_number(getattr(self, name), f"--{name}", integer=True,
                                             minimum=1, maximum=MAX_TOKENS, unit="tokens"))
        if self.batch is not None:
            self.batch = check_number(self.batch, "--batch", integer=True, minimum=1,
                                      maximum=MAX_BATCH, unit="sequences")
        for name in ("tpot_slo_ms", "ttft_slo_ms"):
            flag = "--" + name.removesuffix("_ms").replace("_", "-")
            setattr(self, name, check_number(getattr(self, name), flag, above=0,
                                             maximum=MAX_MS, unit="ms"))


# ------------------------------------------------------------------------------ degrees
MESH_DIM_ORDER = ("pp", "dp", "ep", "tp")  # outermost -> innermost


@dataclass(frozen=True)
class Degrees:
    """Parallel degrees. world = pp * dp * ep * tp; sp is 1 (off) or tp (Megatron SP:
    the residual stream split over tokens inside the tp group)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    sp: int = 1

    def __post_init__(self):
        for k in ("tp", "pp", "ep", "dp", "sp"):
            check_number(getattr(self, k), f"degree {k}", integer=True, minimum=1,
                         maximum=MAX_GPUS)
        if self.sp not in (1, self.tp):
            raise InputError(f"sp={self.sp} must be 1 or equal to tp={self.tp}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.ep * self.dp

    @property
    def replica_gpus(self) -> int:
        """GPUs of one model replica (tp * ep * pp); dp replicas are independent."""
        return self.tp * self.ep * self.pp

    def logical_mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(shape, dim names) for ``init_device_mesh``: dims of size > 1 in
        :data:`MESH_DIM_ORDER`; a single-GPU plan gets ``((1,), ("tp",))``."""
        dims = [(n, getattr(self, n)) for n in MESH_DIM_ORDER if getattr(self, n) > 1]
        if not dims:
            dims = [("tp", 1)]
        return tuple(s for _, s in dims), tuple(n for n, _ in dims)

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "dp": self.dp, "sp": self.sp}

    @classmethod
    def parse(cls, text: str) -> Degrees:
        """Parse ``tp=8,ep=16,pp=2`` (missing degrees default to 1; sp accepts on/off)."""
        kw: dict[str, int] = {}
        for part in str(text).split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise InputError(f"--degrees {text!r}: expected name=value pairs, e.g. tp=8,ep=16")
            k, v = (s.strip() for s in part.split("=", 1))
            if k not in ("tp", "pp", "ep", "dp", "sp"):
                raise InputError(f"--degrees: unknown degree {k!r} (expected tp, pp, ep, dp, sp)")
            if k in kw:
                raise InputError(f"--degrees {text!r}: {k} is given twice")
            if k == "sp" and v in ("on", "off"):
                kw[k] = -1 if v == "on" else 1
                continue
            kw[k] = parse_int_text(v, f"--degrees {k}", minimum=1, maximum=MAX_GPUS)
        if kw.get("sp") == -1:
            kw["sp"] = kw.get("tp", 1)
        return cls(**kw)


# ---------------------------------------------------------------------- per-op choices
# Choice index i of every fused op: 0 = shard weight dim 0, 1 = shard weight dim 1, 2 = none.
CHOICE_NAMES: dict[str, tuple[str, str, str]] = {
    "embedding": ("vocab", "hidden", "rep"),  # weight [vocab, hidden]
    "attn_core": ("heads", "batch", "rep"),  # no weight: heads split / tokens split / none
}
_LINEAR_CHOICES = ("col", "row", "rep")  # weight [out, in]: column / row parallel / none
for _op in ("qkv", "out_proj", "ffn1", "ffn2", "router", "expert_ffn1", "expert_ffn2",
            "shared_ffn1", "shared_ffn2", "lm_head"):
    CHOICE_NAMES[_op] = _LINEAR_CHOICES
NUM_CHOICES = 3

# Placements an op needs on its input and produces on its output (tp mesh dim).
# "FOLLOW" = takes R or S(0) as it comes and produces the same (replicated weights).
FOLLOW = "FOLLOW"
_RULES: dict[str, tuple[str, str]] = {
    "col": ("R", "S(1)"),
    "row": ("S(1)", "P"),
    "rep": (FOLLOW, FOLLOW),
    "vocab": ("R", "P"),  # vocab-parallel embedding: masked lookup, partial sums
    "hidden": ("R", "S(1)"),
    "heads": ("S(1)", "S(1)"),
    "batch": ("S(0)", "S(0)"),
}


def choice_name(op: str, choice: int) -> str:
    return CHOICE_NAMES[op][choice]


def op_placements(op: str, choice: int, incoming: str) -> tuple[str, str]:
    """(placement the op needs on its input, placement of its output) on the tp dim,
    given the placement ``incoming`` arriving at it. For FOLLOW ops an ``R``/``S(0)``
    input passes through; ``S(1)``/``P`` inputs are first made ``R``."""
    need, out = _RULES[choice_name(op, choice)]
    if need == FOLLOW:
        need = incoming if incoming in ("R", "S(0)") else "R"
        out = need
    return need, out


# src -> dst placement on one mesh dim: the collective that repairs it (None = free/local).
_REDISTRIBUTION = {
    ("S(0)", "R"): "all_gather",
    ("S(1)", "R"): "all_gather",
    ("S(0)", "S(1)"): "all_to_all",
    ("S(1)", "S(0)"): "all_to_all",
    ("P", "R"): "all_reduce",
    ("P", "S(0)"): "reduce_scatter",
    ("P", "S(1)"): "reduce_scatter",
}
PLACEMENTS = ("R", "S(0)", "S(1)", "P")


def redistribution(src: str, dst: str) -> str | None:
    """Collective turning placement ``src`` into ``dst`` on one mesh dim (None: local,
    e.g. R -> S(d) is a slice). The byte count is the full (unsharded) tensor size over
    that dim; :mod:`shardc.cost.collectives` gives the time."""
    if src == dst or src == "R":
        return None
    try:
        return _REDISTRIBUTION[(src, dst)]
    except KeyError:
        raise ValueError(f"no redistribution from {src} to {dst}") from None


def dtensor_spelling(p: str) -> str:
    """Placement as plan.json spells it (``P`` -> ``P(sum)``)."""
    return "P(sum)" if p == "P" else p


# ------------------------------------------------------------------------ block branches
# Each branch reads the (normed) residual stream and adds back into it.
BRANCHES: dict[str, tuple[str, ...]] = {
    "attention": ("qkv", "attn_core", "out_proj"),
    "mlp": ("ffn1", "ffn2"),
    "router": ("router",),
    "experts": ("expert_ffn1", "expert_ffn2"),  # between ep all-to-all dispatch and combine
    "shared_experts": ("shared_ffn1", "shared_ffn2"),
}
GLOBAL_OPS = ("embedding", "lm_head")


def residual_placement(degrees: Degrees) -> str:
    """Residual-stream placement on the tp dim: S(0) under sequence parallel, else R."""
    return "S(0)" if degrees.sp > 1 else "R"


def branch_collectives(ops: tuple[str, ...], choices: list[int], start: str, end: str
                       ) -> list[tuple[str, str, str, str]]:
    """Walk a branch: returns [(before_op, src, dst, collective)] for every repair, the
    last entry's before_op being ``"<end>"``. ``start``/``end`` are the placements
    arriving at the first op and required after the last."""
    out = []
    cur = start
    for op, c in zip(ops, choices):
        need, produced = op_placements(op, c, cur)
        coll = redistribution(cur, need)
        if coll:
            out.append((op, cur, need, coll))
        cur = produced
    coll = redistribution(cur, end)
    if coll:
        out.append(("<end>", cur, end, coll))
    return out


@dataclass
class Strategy:
    """A decoded strategy. ``choices`` maps ``"<layer_kind>.<op>"`` (or ``"<op>"`` for
    global ops) to a choice index 0/1/2."""

    degrees: Degrees
    batch: int
    choices: dict[str, int] = field(default_factory=dict)

    def choice_names(self) -> dict[str, str]:
        return {k: choice_name(k.split(".")[-1], v) for k, v in self.choices.items()}


def pipeline_stages(num_layers: int, pp: int) -> list[int]:
    """Stage index of each decoder layer: ``pp`` contiguous stages, sizes differing by at
    most one (earlier stages take the extra layers). The embedding lives on stage 0, the
    final norm and lm_head on stage ``pp - 1``."""
    if pp < 1 or (num_layers and pp > num_layers):
        raise ValueError(f"pp={pp} stages for {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    out: list[int] = []
    for s in range(pp):
        out += [s] * (base + (1 if s < extra else 0))
    return out
