"""The pipeline-parallel part of the torch-style ``parallelize.py`` (plans with pp > 1).

:func:`stage_emit` reads the stage map from plan.json (``params[].stage``: the one stage
map of :func:`shardc.ir.strategy.stage_layer_ranges`) and gives
:func:`shardc.backends.emit_styles.emit_style_parallelize` the lines that make a rank one
pipeline stage (:mod:`shardc.runtime.pipeline`), torchtitan-style::

    stage = world_mesh.get_local_rank('pp')
    # pp=2 stages: 0: embedding, layers 0-1 | 1: layers 2-3, final norm, lm_head
    keep_stage(model, STAGE_LAYERS[stage], first=stage == 0, last=stage == 1)
    ...
    for i in [i for i in LAYER_KINDS['dense_block'] if i in STAGE_LAYERS[stage]]:
        parallelize_module(layers[i], tp_mesh, {...}, src_data_rank=None)
    if stage == 0:  # the embedding is on the first stage
        parallelize_module(model, tp_mesh, {'model.embed_tokens': ...}, src_data_rank=None)
    if stage == 1:  # lm_head is on the last stage
        parallelize_module(model, tp_mesh, {'lm_head': ...}, src_data_rank=None)
    model = pipeline(model, world_mesh, microbatches=2)

The per-kind ``parallelize_module`` plans are the pp = 1 ones
(:func:`shardc.backends.torch_styles.style_plan`), applied on the stage's own submesh (the
mesh dims other than ``pp``). Micro-batches: the cost model's GPipe count (decode: ``pp``;
prefill: one sequence per micro-batch, ``batch / ep``), fewer when a batch does not divide.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.backends.emit_text import _comment, _literal
from shardc.backends.torch_styles import NotCovered

# keep_stage's defaults: an HF causal LM's module paths (only other paths are written out)
_HF_LAYOUT = {"layers_path": "model.layers", "embedding": "model.embed_tokens",
              "positions": (), "final": ("model.norm",), "lm_head": "lm_head"}


def stage_layout(plan, container: str = "model.layers") -> tuple[list[list[int]], dict]:
    """(decoder layers of each pipeline stage, the model-level module paths
    :func:`shardc.runtime.pipeline.keep_stage` keeps per stage), from plan.json
    ``params[].stage`` and the rows' ``layer`` / ``op`` (the IR's;
    :func:`shardc.backends.layout.rows_with_ops` for older plans). ``container``: the
    decoder-layer list's module path. The first stage holds the embedding (op
    ``embedding``) and any other model-level parameter on stage 0 (learned position
    tables), the last stage the rest (final norms, ``lm_head``; a tied ``lm_head`` reads
    the embedding table through its own module). Raises :class:`NotCovered` (a hand-edited
    map) when a layer's parameters sit on two stages, a stage holds no layer or its layers
    are not contiguous, or a model-level parameter is on a middle stage."""
    from shardc.backends.layer_modules import global_modules
    from shardc.backends.layout import rows_with_ops

    pp = plan.strategy().degrees.pp
    rows = rows_with_ops(plan.params)
    of_layer: dict[int, set[int]] = {}
    first, last = [], []
    for p in rows:
        module = str(p["fqn"]).rsplit(".", 1)[0]
        if p.get("layer") is not None:
            of_layer.setdefault(int(p["layer"]), set()).add(int(p["stage"]))
        elif int(p["stage"]) == 0 and (p.get("op") != "lm_head" or pp == 1):
            first.append(module)
        elif int(p["stage"]) == pp - 1 and p.get("op") != "embedding":
            last.append(module)
        else:
            raise NotCovered(f"pp={pp}: {p['fqn']} ({p.get('op') or 'no op'}) on stage "
                             f"{p['stage']} (the runtime keeps the embedding on stage 0, the "
                             f"final norm and lm_head on stage {pp - 1})")
    where = global_modules(rows)
    embedding, lm_head = where.get("embedding"), where.get("lm_head")
    if embedding is None or lm_head is None:
        raise NotCovered(f"pp={pp}: no embedding or lm_head module in the plan's params")
    layout = {"layers_path": container, "embedding": embedding,
              "positions": tuple(dict.fromkeys(m for m in first if m != embedding)),
              "final": tuple(dict.fromkeys(m for m in last if m != lm_head)),
              "lm_head": lm_head}
    stages: list[list[int]] = [[] for _ in range(pp)]
    for layer, on in sorted(of_layer.items()):
        if len(on) != 1:
            raise NotCovered(f"pp={pp}: layer {layer}'s parameters are on stages {sorted(on)}")
        stages[on.pop()].append(layer)
    for s, layers in enumerate(stages):
        if not layers or layers != list(range(layers[0], layers[-1] + 1)):
            raise NotCovered(f"pp={pp}: stage {s} holds layers {layers} (the runtime runs "
                             "contiguous, non-empty stages)")
    return stages, layout


@dataclass
class StageEmit:
    """The lines of a pipeline-parallel ``parallelize.py`` (see the module docstring)."""

    stages: list[list[int]]
    layout: dict  # keep_stage's module paths (see stage_layout)
    microbatches: int
    row_unit: int  # a micro-batch's rows must divide by this (rows split over tp)
    residual_rows_split: int  # the residual stream holds 1/n of the rows per rank (sp)

    @property
    def pp(self) -> int:
        return len(self.stages)

    def data(self) -> str:
        """``STAGE_LAYERS``: one ``range`` of decoder layers per stage (integers only)."""
        ranges = [f"range({ls[0]}, {ls[-1] + 1})" for ls in self.stages]
        line = f"STAGE_LAYERS = [{', '.join(ranges)}]"
        if len(line) <= 99:
            return line
        return "STAGE_LAYERS = [\n" + "".join(f"    {r},\n" for r in ranges) + "]"

    def prologue(self) -> list[str]:
        def what(s: int, layers: list[int]) -> str:
            span = f"layer {layers[0]}" if len(layers) == 1 \
                else f"layers {layers[0]}-{layers[-1]}"
            parts = (["embedding"] if s == 0 else []) + [span] \
                + (["final norm, lm_head"] if s == self.pp - 1 else [])
            return f"{s}: {', '.join(parts)}"

        paths = [f"{k}={_literal(v)}" for k, v in self.layout.items()
                 if v != _HF_LAYOUT[k]]  # module paths from plan.json: literals
        head = f"model, STAGE_LAYERS[stage], first=stage == 0, last=stage == {self.pp - 1}"
        call = f"    keep_stage({', '.join([head, *paths])})"
        if len(call) > 99:
            call = "\n".join(["    keep_stage(", f"        {head},",
                              *(f"        {p}," for p in paths), "    )"])
        return ["    stage = world_mesh.get_local_rank('pp')",
                _comment(f"pp={self.pp} stages: "
                         + " | ".join(what(s, ls) for s, ls in enumerate(self.stages))),
                call]

    @staticmethod
    def layer_loop(kind: str) -> str:
        return (f"    for i in [i for i in LAYER_KINDS[{_literal(kind)}] "
                "if i in STAGE_LAYERS[stage]]:  # this stage's layers")

    def model_blocks(self, entries) -> list[tuple[str, list]]:
        """(``if`` line, entries) per stage holding model-level modules."""
        on_first = {self.layout["embedding"], *self.layout["positions"]}
        first = [e for e in entries if e.suffix in on_first]
        last = [e for e in entries if e.suffix not in on_first]
        out = []
        if first:
            out.append(("    if stage == 0:  # the embedding is on the first stage", first))
        if last:
            out.append((f"    if stage == {self.pp - 1}:  # lm_head is on the last stage", last))
        return out

    def runner(self) -> list[str]:
        args = f"microbatches={self.microbatches}"
        if self.row_unit > 1:
            args += f", row_unit={self.row_unit}"
        if self.residual_rows_split > 1:
            args += f", residual_rows_split={self.residual_rows_split}"
        return [_comment(f"pipeline: ScheduleGPipe over pp={self.pp}, forward only, up to "
                         f"{self.microbatches} micro-batches; activations go to the next"),
                _comment("stage's rank with the same dp/ep/tp coordinates; logits on the last "
                         "stage, None on the others"),
                f"    model = pipeline(model, world_mesh, {args})"]


def stage_emit(plan, style_plan) -> StageEmit:
    """The :class:`StageEmit` of a pp > 1 ``plan`` whose per-kind plans are ``style_plan``."""
    st = plan.strategy()
    deg = st.degrees
    batch_split = any("BatchSplitAttention" in e.style for kp in style_plan.kinds
                      for e in kp.entries)
    rows_split = deg.tp if deg.sp > 1 else 1
    phase = str(plan.workload.get("phase", "decode"))
    micro = deg.pp if phase == "decode" else max(1, int(st.batch) // deg.ep)
    return StageEmit(*stage_layout(plan, style_plan.layers), micro,
                     deg.tp if (batch_split or rows_split > 1) else 1, rows_split)
