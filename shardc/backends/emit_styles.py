"""Emit the torch-style ``parallelize.py``: one ``parallelize_module`` plan per layer kind.

The file reads as the parallelism it applies (torchtitan-style)::

    for i in LAYER_KINDS['dense_block']:
        parallelize_module(layers[i], tp_mesh, {
            'self_attn.q_proj': ColwiseParallel(),  # qkv col: no collective
            'self_attn.o_proj': RowwiseParallel(),  # out_proj row: all_reduce P->R
            ...
        }, src_data_rank=None)

from :func:`shardc.backends.torch_styles.style_plan`. ``inline=True`` (``shardc compile
--standalone``) pastes the torch-only runtime (:data:`shardc.runtime.SOURCES`) into the
file, its imports hoisted and merged, so the file imports only torch; otherwise it imports
``shardc.runtime``. Input reaches the file as in :mod:`shardc.backends.dtensor`: layer-kind
names and module suffixes (from plan.json) as literals (``_literal``), comments through
``one_line``; style code is built from a fixed vocabulary only.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import lru_cache
from pathlib import Path

from shardc.backends.emit_runtime import TAIL_NAMES, runtime_data, runtime_tail
from shardc.backends.emit_text import _DOC, _comment, _literal, _ranges, doc_fields
from shardc.backends.pipeline_styles import stage_emit
from shardc.backends.torch_styles import style_plan
from shardc.fingerprint import placed_table
from shardc.ir.windows import variant_text

RUNTIME_DIR = Path(__file__).resolve().parents[1] / "runtime"
FINGERPRINT_SOURCE = Path(__file__).resolve().parents[1] / "fingerprint.py"  # inlined too
# names the generated part may use, and where they come from
_TORCH_NAMES = {"ColwiseParallel": "torch.distributed.tensor.parallel",
                "RowwiseParallel": "torch.distributed.tensor.parallel",
                "PrepareModuleInput": "torch.distributed.tensor.parallel",
                "parallelize_module": "torch.distributed.tensor.parallel",
                "Replicate": "torch.distributed.tensor", "Shard": "torch.distributed.tensor"}
_RUNTIME_NAMES = ("BatchSplitAttention", "CoreRowsAttention", "ExpertParallel",
                  "FullWidthNormParallel", "GatheredExperts", "GroupedKVAttention",
                  "HeadParallelAttention", "HeadSlices", "Mamba2HeadsParallel",
                  "PrepareHiddenStates",
                  "ReplicateParallel", "RouterParallel",
                  "WeightColwiseParallel", "WeightRowwiseParallel",
                  "decoder_layers", "install_batch_split", "keep_stage",
                  "pipeline", "submesh")
_STANDALONE_NOTE = ("\n\nStandalone: imports only torch; shardc's few ParallelStyles (what torch "
                    "lacks) are\ninlined below, ahead of the plan.")


def _name_key(name: str):
    """isort's order-by-type: CONSTANTS, Classes, then functions, each alphabetical."""
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name


def _import_block(straight: set[str], froms: dict[str, set[str]]) -> str:
    """isort's layout: the standard library's imports (the inlined ``--bench`` entry's),
    then a blank line and torch's."""
    def std(m: str) -> bool:
        return m.split(".")[0] in sys.stdlib_module_names

    stdlib = _import_lines({m for m in straight if std(m)},
                           {m: ns for m, ns in froms.items() if std(m)})
    rest = _import_lines({m for m in straight if not std(m)},
                         {m: ns for m, ns in froms.items() if not std(m)})
    return "\n\n".join(b for b in (stdlib, rest) if b)


def _import_lines(straight: set[str], froms: dict[str, set[str]]) -> str:
    lines = [f"import {m}" for m in sorted(straight, key=lambda m: m.split(" as ")[0])]
    for m, ns in sorted(froms.items()):
        names = sorted(ns, key=_name_key)
        line = f"from {m} import {', '.join(names)}"
        if len(line) > 100:  # isort's wrapped form
            line = f"from {m} import (\n" + "".join(f"    {n},\n" for n in names) + ")"
        lines.append(line)
    return "\n".join(lines)


@lru_cache(maxsize=None)
def _runtime_module(path: str) -> tuple[str, frozenset, tuple]:
    """One inlined module's code (a runtime module, or the model check) without its
    docstring and imports, and its imports (``import x`` names; ``(module, names)`` of each
    ``from`` import but shardc's and ``__future__``), parsed once per process."""
    src = Path(path).read_text()
    lines = src.splitlines()
    drop, straight, froms = set(), set(), []
    tree = ast.parse(src)
    for i, node in enumerate(tree.body):
        doc = i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if isinstance(node, ast.Import):
            straight.update(a.name + (f" as {a.asname}" if a.asname else "")
                            for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.module != "__future__" and not node.module.startswith("shardc"):
                froms.append((node.module, tuple(a.name for a in node.names)))
        elif not doc:
            continue
        drop.update(range(node.lineno - 1, node.end_lineno))
    body = "\n".join(line for i, line in enumerate(lines) if i not in drop).strip("\n")
    return body, frozenset(straight), tuple(froms)


def _runtime_sources(straight: set[str], froms: dict[str, set[str]], pipeline: bool = False) -> str:
    """The runtime modules' code without docstrings and imports (collected into
    ``straight`` / ``froms``), in :data:`shardc.runtime.SOURCES` order (then
    :data:`~shardc.runtime.PIPELINE_SOURCES` when ``pipeline``)."""
    from shardc.runtime import PIPELINE_SOURCES, SOURCES

    parts = []
    sources = [(f"shardc.runtime.{name[:-3]}", str(RUNTIME_DIR / name))
               for name in SOURCES + (PIPELINE_SOURCES if pipeline else ())]
    for label, path in [("shardc.fingerprint", str(FINGERPRINT_SOURCE))] + sources:
        body, names, from_imports = _runtime_module(path)
        straight.update(names)
        for module, imported in from_imports:
            froms.setdefault(module, set()).update(imported)
        parts.append(f"# ---- {label} (inlined; torch only) ----\n\n\n{body}")
    return "\n\n\n".join(parts)


def _plan_dict(entries, indent: int) -> list[str]:
    pad = " " * indent
    return [f"{pad}    {_literal(e.suffix)}: {e.style},  # {_comment(e.comment, 0)[2:]}"
            for e in entries]


def emit_style_parallelize(plan, inline: bool = True) -> str:
    """``parallelize.py`` of ``plan`` on torch's parallel API (see the module docstring).
    Raises :class:`shardc.backends.torch_styles.NotCovered` naming what the torch-style
    runtime does not cover yet."""
    sp = style_plan(plan)
    pipe = stage_emit(plan, sp) if plan.strategy().degrees.pp > 1 else None
    kinds = plan.layer_kind_map()
    shape = tuple(int(s) for s in plan.logical_mesh["shape"])
    dim_names = tuple(str(n) for n in plan.logical_mesh["dim_names"])
    body = ["def parallelize(model, world_mesh=None):",
            '    """Place every parameter of ``model`` per the plan; returns the model to call."""',
            "    if world_mesh is None:",
            '        device = "cuda" if torch.cuda.is_available() else "cpu"',
            "        world_mesh = init_device_mesh(device, MESH_SHAPE, "
            "mesh_dim_names=MESH_DIM_NAMES)",
            "    check_model(model, MODEL_FINGERPRINT)  # the model the plan was made for",
            "    model.shardc_world_mesh = world_mesh  # generate() runs on the same mesh"]
    if pipe:  # this rank keeps its pipeline stage only
        body[1] = ('    """Keep this rank\'s pipeline stage of ``model``, place its parameters '
                   'per the plan;\n    returns the pipeline to call (logits on the last stage, '
                   'None on the others)."""')
        body += pipe.prologue()
    if sp.tp > 1:
        body.append("    tp_mesh = submesh(world_mesh, ('tp',))")
    if sp.expert_mesh:
        body.append("    expert_mesh = submesh(world_mesh, ('ep', 'tp'))  # experts: ep x tp")
    if any(kp.entries or kp.experts is not None for kp in sp.kinds):
        body.append(f"    layers = decoder_layers(model, {_literal(sp.layers)})")
    variants = {k["name"]: variant_text(k) for k in plan.layer_kinds}  # shown with a window
    if not any(k.get("attention") == "sliding_window" for k in plan.layer_kinds):
        variants = {}
    for kp in sp.kinds:
        variant = variants.get(kp.kind)
        body.append(_comment(f"{kp.kind} x {len(kp.layers)}" + (f": {variant}" if variant
                                                                 else "")))
        body += [_comment(f"  {n}") for n in kp.notes]
        if not kp.entries and kp.experts is None:
            body.append(_comment("  nothing to shard over tp: weights stay whole"))
            continue
        body.append(pipe.layer_loop(kp.kind) if pipe else
                    f"    for i in LAYER_KINDS[{_literal(kp.kind)}]:")
        if kp.entries:
            body.append("        parallelize_module(layers[i], tp_mesh, {")
            body += _plan_dict(kp.entries, 8)
            body.append("        }, src_data_rank=None)")
        if kp.experts is not None:
            body.append(f"        # {_comment(kp.experts.comment, 0)[2:]}")
            body.append(f"        parallelize_module(layers[i].get_submodule("
                        f"{_literal(kp.experts.suffix)}), expert_mesh, {kp.experts.style}, "
                        "src_data_rank=None)")
    for head, entries in (pipe.model_blocks(sp.model_entries) if pipe else
                          [("", sp.model_entries)] if sp.model_entries else []):
        pad = "    " * (1 + bool(head))
        body += [head] if head else []
        body.append(f"{pad}parallelize_module(model, tp_mesh, {{")
        body += _plan_dict(entries, len(pad))
        body.append(f"{pad}}}, src_data_rank=None)")
    body.append("    check_placed(model, PLACED, world_mesh)  # every split parameter was split")
    body += pipe.runner() if pipe else []
    body.append(_comment("dp x ep: each rank serves its slice of the batch (flattened mesh); "
                         "logits all-gathered"))
    deg = plan.strategy().degrees
    if deg.sp > 1 and pipe:
        body.append(_comment("sp through pipeline stages: a padding mask is refused"))
        body.append("    return install_batch_split(model, world_mesh, padding_ok=False)")
    elif deg.sp > 1:
        body.append(_comment("sp: masks are built for this tp rank's rows (attention over "
                             "whole rows gathers them)"))
        body.append("    return install_batch_split(model, world_mesh, tp_rows=True)")
    else:
        body.append("    return install_batch_split(model, world_mesh)")
    code_text = "\n".join(body)
    st = plan.strategy()
    # the same six data assignments as the default file's (tests/test_security.py)
    data = "\n".join([f"MESH_SHAPE = {_literal(shape)}",
                      f"MESH_DIM_NAMES = {_literal(dim_names)}",
                      f"DEGREES = {_literal(st.degrees.as_dict())}",
                      f"BATCH = {_literal(int(st.batch))}",
                      f"LAYER_KINDS = {_literal(_ranges(kinds))}",
                      f"CHOICES = {_literal({str(o['name']): str(o['choice']) for o in plan.ops})}",
                      f"MODEL_FINGERPRINT = {_literal(plan.fingerprint())}",
                      f"PLACED = {_literal(placed_table(plan.params, plan.spmd_dims))}"]
                     + ([pipe.data()] if pipe else []) + [runtime_data(plan)])
    used = {n for n in (*_TORCH_NAMES, *_RUNTIME_NAMES) if re.search(rf"\b{n}\(", code_text)}
    straight: set[str] = {"torch"}
    froms: dict[str, set[str]] = {"torch.distributed.device_mesh": {"init_device_mesh"}}
    runtime = ""
    if inline:
        for n in used & set(_TORCH_NAMES):
            froms.setdefault(_TORCH_NAMES[n], set()).add(n)
        runtime = "\n\n" + _runtime_sources(straight, froms, pipeline=pipe is not None)
    else:  # torch's styles and placements too, re-exported by shardc.runtime: one import
        froms["shardc.runtime"] = used | set(TAIL_NAMES)
        froms["shardc.fingerprint"] = {"check_model", "check_placed"}
    third = {m: ns for m, ns in froms.items() if not m.startswith("shardc")}
    imports = _import_block(straight, third)
    if "shardc.runtime" in froms:
        imports += "\n\n" + _import_block(set(), {m: ns for m, ns in froms.items()
                                                   if m.startswith("shardc")})
    doc = _DOC.format(**doc_fields(plan), standalone_note=_STANDALONE_NOTE if inline else "")
    future = "\nfrom __future__ import annotations\n" if inline else ""
    gap = "\n\n\n" if inline else "\n\n"  # isort: one blank line after imports, two after defs
    return (f"{doc}{future}\n{imports}{runtime}{gap}{data}\n\n\n{code_text}\n"
            f"{runtime_tail()}")
