"""The sharding strategy: the vocabulary shared by the cost model, the search and the backend.

A strategy is (parallel degrees, batch, per-fused-op choices). This module defines

* :class:`Mesh` (the physical cluster ``GxN``) and :class:`Workload`;
* :class:`Degrees` -- tp, pp, ep, dp, sp validated in one place, and the logical mesh
  they imply (dims ordered outermost -> innermost: ``pp, dp, ep, tp``; tp innermost, so a
  tp group of <= G ranks sits inside one NVLink domain);
* :class:`Strategy` (degrees, batch, per-fused-op choice indices) and the residual-stream
  placement it implies; what each choice means (placements, collectives, cost modes,
  legality, ParallelStyle) is the sharding contract, :mod:`shardc.ir.contract`;
* the pipeline stage map (:func:`stage_layer_ranges`).

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
from shardc.ir.contract import choice_name
from shardc.validate import (
    MAX_BATCH,
    MAX_GPUS,
    MAX_MS,
    MAX_TOKENS,
    check_number,
    parse_int_text,
)

# ------------------------------------------------------------------------- mesh, workload
_MESH_RE = re.compile(r"^\s*([0-9]+)x([0-9]+)\s*$")


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


QUANT_FORMATS = ("bf16", "fp8")  # --weights / --kv-cache values (Workload.weights, .kv_cache)


def format_bytes(fmt: str, native_bytes: float) -> float:
    """Bytes per element stored in format ``fmt``: 1 for ``fp8``; for ``bf16`` the model's
    own element size ``native_bytes`` (2 for a bf16 model)."""
    return 1.0 if fmt == "fp8" else float(native_bytes)


PHASES = ("decode", "prefill", "serve")
SERVE_MODES = ("auto", "agg", "disagg")
# --routing (Workload.routing): the expert routing model of shardc.cost.routing
ROUTING_KINDS = ("balanced", "uniform", "powerlaw")
DEFAULT_ROUTING = "uniform"
FP8_SCALINGS = ("per-tensor", "per-token", "block")  # --fp8-scaling (shardc.cost.quantisation)
MAX_REDUNDANT_EXPERTS = 4096


def parse_routing(text: str) -> tuple[str, float]:
    """``(kind, alpha)`` of a ``--routing`` value (``balanced``, ``uniform`` or
    ``powerlaw:ALPHA``, ALPHA in [0, 4]); InputError naming the accepted forms."""
    s = str(text).strip().lower()
    kind, _, arg = s.partition(":")
    if kind in ("balanced", "uniform") and not arg:
        return kind, 0.0
    if kind == "powerlaw":
        try:
            alpha = float(arg)
        except ValueError:
            alpha = float("nan")
        if 0.0 <= alpha <= 4.0:  # False for NaN
            return kind, alpha
    raise InputError(f"--routing {text!r}: expected balanced, uniform or powerlaw:ALPHA "
                     "(ALPHA between 0 and 4, e.g. powerlaw:0.37)")


@dataclass
class Workload:
    """What is served. ``batch`` None means "search it" (``--batch auto``).

    context: KV-cache length in tokens seen by each decode step; prompt: prompt tokens per
    sequence for prefill; SLOs in milliseconds. ``weights`` / ``kv_cache``: the number format
    served (:data:`QUANT_FORMATS`): ``fp8`` = 1 byte per element (FP8 weights also run the
    GEMMs at the FP8 peak); ``bf16`` = the model's 16-bit dtype. ``phase="serve"`` (SPEC
    section 11): requests of ``isl`` input and ``osl`` output tokens under both SLOs, served
    by one aggregated pool (``mode="agg"``), a prefill and a decode pool (``"disagg"``) or the
    better (``"auto"``); ``batch`` then caps the running sequences per replica. ``routing``:
    the expert routing model (:func:`parse_routing`, :mod:`shardc.cost.routing`);
    ``redundant_experts``: EPLB's extra expert slots per EP group (0 = none);
    ``fp8_scaling``: how FP8 linears scale their activations (:data:`FP8_SCALINGS`).
    """

    phase: str = "decode"
    batch: int | None = None
    context: int = 4096
    prompt: int = 2048
    tpot_slo_ms: float = 50.0
    ttft_slo_ms: float = 2000.0
    weights: str = "bf16"
    kv_cache: str = "bf16"
    isl: int = 2048
    osl: int = 512
    mode: str = "auto"
    routing: str = DEFAULT_ROUTING
    redundant_experts: int = 0
    fp8_scaling: str = "per-tensor"

    def __post_init__(self):
        if self.phase not in PHASES:
            raise InputError(f"--phase {self.phase!r}: expected decode, prefill or serve")
        if self.mode not in SERVE_MODES:
            raise InputError(f"--mode {self.mode!r}: expected auto, agg or disagg")
        if self.fp8_scaling not in FP8_SCALINGS:
            raise InputError(f"--fp8-scaling {self.fp8_scaling!r}: expected "
                             f"{', '.join(FP8_SCALINGS)}")
        kind, alpha = parse_routing(self.routing)
        self.routing = kind if kind != "powerlaw" else f"powerlaw:{alpha:g}"
        self.redundant_experts = check_number(self.redundant_experts, "--redundant-experts",
                                              integer=True, minimum=0,
                                              maximum=MAX_REDUNDANT_EXPERTS, unit="experts")
        for name in ("weights", "kv_cache"):
            value = getattr(self, name)
            if value not in QUANT_FORMATS:
                raise InputError(f"--{name.replace('_', '-')} {value!r}: expected "
                                 f"{' or '.join(QUANT_FORMATS)}")
        for name in ("context", "prompt", "isl", "osl"):
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
    the residual stream split over tokens inside the tp group).

    ``ep`` is the attention data-parallel degree inside a replica (``dp_attn`` on the command
    line): the tp x ep ranks of a replica run attention as ep groups of tp ranks, each on its
    own sequences. The routed experts are split over the same tp x ep ranks as ``moe_tp``
    (each expert's ffn column / row split) x ``moe_ep`` (experts divided) with
    ``moe_tp * moe_ep = tp * ep``. 0 for both (the default) = experts at the attention tp
    (``moe_tp = tp, moe_ep = ep``: the expert dim over ep, the DeepEP all-to-all dispatch);
    any other split (e.g. ``tp=1 ep=8 moe_tp=8``: AIConfigurator's ``tp1 dp8 etp8``) gathers
    the routed tokens over the ep ranks before the experts and reduce-scatters after
    (:mod:`shardc.cost.moe_dispatch`); a split equal to the default is stored as 0, so the
    two spellings are one strategy."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    sp: int = 1
    moe_tp: int = 0
    moe_ep: int = 0

    def __post_init__(self):
        for k in ("tp", "pp", "ep", "dp", "sp"):
            check_number(getattr(self, k), f"degree {k}", integer=True, minimum=1,
                         maximum=MAX_GPUS)
        for k in ("moe_tp", "moe_ep"):
            check_number(getattr(self, k), f"degree {k}", integer=True, minimum=0,
                         maximum=MAX_GPUS)
        if self.sp not in (1, self.tp):
            raise InputError(f"sp={self.sp} must be 1 or equal to tp={self.tp}")
        group = self.tp * self.ep
        mt, me = int(self.moe_tp), int(self.moe_ep)
        if mt or me:
            if not mt:
                mt = group // me if group % me == 0 else 0
            if not me:
                me = group // mt if group % mt == 0 else 0
            if not mt or not me or mt * me != group:
                raise InputError(f"moe_tp={self.moe_tp or '?'} x moe_ep={self.moe_ep or '?'}: "
                                 f"the experts' split must multiply to tp x dp_attn = "
                                 f"{self.tp} x {self.ep} = {group} (the ranks attention runs "
                                 "on)")
            if (mt, me) == (self.tp, self.ep):
                mt = me = 0
            elif self.sp > 1:
                raise InputError(f"sp=on with moe_tp={mt} x moe_ep={me} != tp={self.tp} x "
                                 f"dp_attn={self.ep}: sequence parallelism needs the experts "
                                 "at the attention tp")
        object.__setattr__(self, "moe_tp", mt)
        object.__setattr__(self, "moe_ep", me)

    @property
    def experts_resplit(self) -> bool:
        """The experts are split other than (tp, ep) (the all-gather dispatch path)."""
        return self.moe_tp > 0

    @property
    def expert_tp(self) -> int:
        """Each expert's ffn split (moe_tp; tp by default)."""
        return self.moe_tp or self.tp

    @property
    def expert_ep(self) -> int:
        """Groups the experts are divided over (moe_ep; ep by default)."""
        return self.moe_ep or self.ep

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.ep * self.dp

    @property
    def replica_gpus(self) -> int:
        """GPUs of one model replica (tp * ep * pp); dp replicas are independent."""
        return self.tp * self.ep * self.pp

    def logical_mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(shape, dim names) for ``init_device_mesh``: dims of size > 1 in
        :data:`MESH_DIM_ORDER`; when no dim but ``pp`` is larger than 1 a ``tp`` dim of
        size 1 is kept (``((1,), ("tp",))`` for one GPU), so there is always at least one
        SPMD dim for placements to refer to."""
        dims = [(n, getattr(self, n)) for n in MESH_DIM_ORDER if getattr(self, n) > 1]
        if all(n == "pp" for n, _ in dims):
            dims.append(("tp", 1))
        return tuple(s for _, s in dims), tuple(n for n, _ in dims)

    def spmd_dims(self) -> list[str]:
        """The logical mesh dims every ``placements`` list refers to, in order: the logical
        mesh minus ``pp`` (pipeline stages hold whole tensors). Never empty."""
        return [n for n in self.logical_mesh()[1] if n != "pp"]

    def as_dict(self) -> dict[str, int]:
        """tp, pp, ep, dp, sp, and ``moe_tp`` / ``moe_ep`` only when the experts are split
        other than (tp, ep) (plans of the default split read as before)."""
        out = {"tp": self.tp, "pp": self.pp, "ep": self.ep, "dp": self.dp, "sp": self.sp}
        if self.experts_resplit:
            out.update(moe_tp=self.moe_tp, moe_ep=self.moe_ep)
        return out

    @classmethod
    def parse(cls, text: str) -> Degrees:
        """Parse ``tp=8,ep=16,pp=2`` (missing degrees default to 1; sp accepts on/off;
        ``dp_attn`` is ``ep``'s other name)."""
        kw = parse_degree_fields(text)
        if kw.get("sp") == SP_ON:
            kw["sp"] = kw.get("tp", 1)
        return cls(**kw)


DEGREE_NAMES = ("tp", "pp", "ep", "dp", "sp", "dp_attn", "moe_tp", "moe_ep")  # --degrees

SP_ON = -1  # ``sp=on`` in --degrees: sequence parallel over the tp group


def parse_degree_fields(text: str) -> dict[str, int]:
    """The degrees named in ``tp=8,ep=16,pp=2`` (only those given; ``sp=on`` -> :data:`SP_ON`,
    ``sp=off`` -> 1; ``dp_attn`` -> ``ep``). Unknown or repeated names and non-integers are
    an InputError."""
    kw: dict[str, int] = {}
    for part in str(text).split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise InputError(f"--degrees {text!r}: expected name=value pairs, e.g. tp=8,ep=16")
        k, v = (s.strip() for s in part.split("=", 1))
        given = k
        if k not in DEGREE_NAMES:
            raise InputError(f"--degrees: unknown degree {k!r} (expected "
                             f"{', '.join(DEGREE_NAMES)})")
        if k == "dp_attn":  # attention data parallel: the ep mesh dim
            if "ep" in kw:
                raise InputError(f"--degrees {text!r}: dp_attn and ep name the same degree "
                                 "(give one)")
            k = "ep"
        if k in kw:
            raise InputError(f"--degrees {text!r}: {k if k != 'ep' else 'ep / dp_attn'} is "
                             "given twice")
        if k == "sp" and v in ("on", "off"):
            kw[k] = SP_ON if v == "on" else 1
            continue
        kw[k] = parse_int_text(v, f"--degrees {given}", minimum=1, maximum=MAX_GPUS)
    return kw


def residual_placement(degrees: Degrees) -> str:
    """Residual-stream placement on the tp dim: S(0) under sequence parallel, else R."""
    return "S(0)" if degrees.sp > 1 else "R"


@dataclass
class Strategy:
    """A decoded strategy. ``choices`` maps ``"<layer_kind>.<op>"`` (or ``"<op>"`` for
    global ops) to a choice index 0/1/2."""

    degrees: Degrees
    batch: int
    choices: dict[str, int] = field(default_factory=dict)

    def choice_names(self) -> dict[str, str]:
        return {k: choice_name(k.split(".")[-1], v) for k, v in self.choices.items()}


def stage_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """The decoder layers each of ``pp`` pipeline stages runs: contiguous ranges whose
    sizes differ by at most one, earlier stages taking the extra layers (the last stage
    also carries the final norm and lm_head; the embedding on stage 0 is a cheap lookup).
    The one stage map of shardc: the cost model, trace.json, annotate, plan.json and the
    runtime all read it."""
    if pp < 1 or (num_layers and pp > num_layers):
        raise ValueError(f"pp={pp} stages for {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def pipeline_stages(num_layers: int, pp: int) -> list[int]:
    """Stage index of each decoder layer (:func:`stage_layer_ranges` as a per-layer list).
    The embedding lives on stage 0, the final norm and lm_head on stage ``pp - 1``."""
    return [s for s, layers in enumerate(stage_layer_ranges(num_layers, pp)) for _ in layers]


def strategy_from_names(degrees: dict, choices: dict, batch: int = 1) -> Strategy:
    """Strategy from plan-style data: ``{"tp": 8, ...}`` and ``{"<kind>.<op>": "col", ...}``
    (choice names or indices)."""
    from shardc.ir.contract import CHOICE_NAMES

    idx = {}
    for slot, c in choices.items():
        names = CHOICE_NAMES[slot.split(".")[-1]]
        idx[slot] = c if isinstance(c, int) else names.index(c)
    return Strategy(Degrees(**degrees), int(batch), idx)
