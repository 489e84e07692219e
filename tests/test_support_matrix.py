"""The support matrix, docs/support.md, generated from running the pipeline per family.

For every family of :data:`family_matrix.FAMILIES` (a public config.json under
examples/configs/):

* traced: the config's first 4 decoder layers at full width, traced on ``meta`` and passed
  (frontend + passes; the layer pattern of every family repeats within 4 layers);
* cost-modelled: that graph planned by ``shardc.compile(..., search="megatron")`` on 8x1
  H100 (decode; context 4096 or the model's maximum if shorter);
* backend-runnable: the tiny variant passes the compile-time backend check (the first
  runtime's adapter, or else the torch-style runtime covering every case below), and on 4
  gloo ranks the emitted ``parallelize.py`` of a tp=2 plan (dp or ep 2) plus a heads split
  with the KV cache, a batch-split attention with row qkv (rep qkv on the torch-style
  runtime alone) and padding, and 2 pipeline stages (tp=2) give the unsharded logits within
  1e-4 (relative); a model the backend cannot run is still planned (plan.json, launch
  scripts) without a ``parallelize.py``;
* verified: ``shardc verify <config.json> --plan plan.json --world 2`` exits 0 -- pending
  until ``shardc verify`` takes a config.json (``shardc.frontends.tiny_config``).

The committed docs/support.md must equal what this test renders: the test fails when they
differ, and ``SHARDC_UPDATE_DOCS=1`` rewrites the file instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from family_matrix import FAMILIES, ROOT, config_path, write_tiny_model_file

from shardc.errors import ShardcError

DOC = ROOT / "docs" / "support.md"
TOL = 1e-4
MEGATRON = {"qkv": "col", "attn_core": "heads", "out_proj": "row", "ffn1": "col", "ffn2": "row",
            "shared_ffn1": "col", "shared_ffn2": "row", "router": "rep", "expert_ffn1": "col",
            "expert_ffn2": "row"}
NOTES = {
    "llama3_1_8b": "llama3 rope scaling",
    "qwen2_5_7b": "q/k/v biases",
    "qwen3_8b": "per-head q/k RMSNorm",
    "qwen3_30b_a3b": "per-head q/k RMSNorm; 128 experts, top-8",
    "mixtral_8x7b": "8 experts, top-2",
    "olmoe_1b_7b": "q/k RMSNorm over the whole projection (all-reduced under a heads split); "
                   "top-k not renormalised",
    "deepseek_v2_lite": "MLA without q low-rank projection; softmax greedy top-6, 2 shared "
                        "experts; complex rotary",
    "deepseek_v3": "MLA; sigmoid group-limited routing, shared expert",
    "phi3_5_moe": "longrope (rope factors here are placeholders of the right length); "
                  "sparsemixer routing; LayerNorm; attention and lm_head biases",
    "gemma2_9b": "eager attention (sdpa refused): attention and final logit softcapping, "
                 "alternating sliding window, pre/post feed-forward norms, tied lm_head",
    "llama4_scout": "multimodal config: text_config taken; transformers runs every expert on "
                    "every token",
    "gpt_oss_20b": "eager attention (sdpa refused); attention sinks, expert and router biases",
    "gpt2": "Conv1D weights [in, out], packed q/k/v (and bias) in c_attn, learned positions "
            "(replicated), tied lm_head; 1024 positions",
    "qwen2_57b_a14b": "shared expert with its sigmoid gate (a per-token scalar gate, kept "
                      "whole); 64 experts, top-8, not renormalised; torch-style runtime",
    "ernie4_5_21b_a3b": "expert score bias (moe_statics.e_score_correction_bias, read by the "
                        "router); dense layer 0, 2 shared experts; torch-style runtime",
    "phi4": "packed qkv_proj (sliced at config head counts: the rank's copy is scaled) and "
            "gate_up_proj; torch-style runtime",
    "granite3_0_3b_a800m": "block_sparse_moe layout, embedding / residual / attention / logits "
                           "multipliers; 40 experts, top-8; torch-style runtime",
    "dbrx": "fused experts (one [E * f, h] parameter per projection, traced as grouped "
            "matmuls over [E, f, h] views: plan.json lists them so, parallelize.py places them "
            "so, col/row or rep/rep over tp); 16 experts, top-4; packed Wqkv with clip_qkv; "
            "LayerNorm without bias",
    "kimi_k2": "model_type kimi_k2 (remote code, never run) built as transformers' "
               "DeepseekV3ForCausalLM; fp8 128x128 block quantization_config (plans in fp8)",
    "qwen3_next_80b_a3b": "3 of 4 layers Gated DeltaNet (op kinds causal_conv + "
                          "recurrent_scan: a constant recurrent + conv state per sequence, "
                          "split by heads, no KV cache), gated attention in the rest; 512 "
                          "experts, top-10, shared expert with its sigmoid gate",
    "nemotron_h_8b": "Mamba-2 layers (causal_conv + chunked SSD recurrent_scan, constant "
                     "state split by heads in 8 groups, no KV cache), MLP-only layers (relu2) "
                     "and attention at layers 7, 18, 29, 40 (the first 4 layers traced here "
                     "are Mamba-2 and MLP)",
    "jamba_v0_1": "Mamba layers (causal_conv + selective-scan recurrent_scan, constant state "
                  "split by channels) with attention at layers 4, 12, 20, 28 (the first 4 "
                  "layers traced here are all Mamba); 16 experts, top-2, every other layer",
}
# families the first runtime's adapter refuses, run by the torch-style runtime alone: every
# case is an emitted parallelize.py, batch-split attention after a replicated qkv (the
# torch-style path's cover)
TORCH_STYLE_ONLY_BATCH = {"qkv": "rep", "attn_core": "batch", "out_proj": "col"}


def _cut_config(name: str, folder: Path, layers: int = 4) -> Path:
    """The family's config.json with its first ``layers`` decoder layers (full width)."""
    data = {k: v for k, v in json.loads(config_path(name).read_text()).items()
            if k != "auto_map"}
    cfg = data.get("text_config", data)
    for key in ("num_hidden_layers", "n_layer", "n_layers"):
        if key in cfg:
            cfg[key] = min(int(cfg[key]), layers)
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:layers]
    if "hybrid_override_pattern" in cfg:  # Nemotron-H: one character per layer
        cfg["hybrid_override_pattern"] = cfg["hybrid_override_pattern"][:layers]
    out = folder / name / (f"config_{layers}.json" if layers != 4 else "config.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data))
    return out


def _refused(e: Exception, folder: Path) -> str:
    code = e.exit_code if isinstance(e, ShardcError) else 1
    msg = str(e).replace(str(folder) + "/", "").replace(str(ROOT) + "/", "")
    return f"no (exit {code}): {msg}"


def _trace_and_plan(name: str, folder: Path):
    """(traced cell, cost-modelled cell, plan or None)."""
    import shardc
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Workload

    try:
        graph = load_graph(_cut_config(name, folder))
    except ShardcError as e:
        return _refused(e, folder), "n/a (not traced)", None
    context = min(4096, int(graph.config.get("max_position_embeddings") or 4096))
    try:
        plan = shardc.compile(graph, mesh="8x1", search="megatron", budget=1,
                              workload=Workload(context=context))
    except ShardcError as e:
        return "yes", _refused(e, folder), None
    return "yes", "yes", plan


def _cases(name: str, model_file: Path, folder: Path, problem: str | None) -> list:
    """Emitted parallelize.py of a tp=2 plan + three runtime strategies for the tiny variant.
    ``problem``: why the first runtime's adapter refuses the model (None: it accepts); then
    the torch-style runtime must cover every case (each one an emitted parallelize.py), else
    :class:`ShardcError` says why (``backend`` of plan.json: no parallelize.py)."""
    from shardc.backends.support import torch_style_verdict
    from shardc.backends.verify import Case
    from shardc.errors import InputError
    from shardc.frontends import load_graph
    from shardc.ir.contract import CHOICE_NAMES
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    graph = load_graph(model_file, tiny=True)
    kinds = {k.name: list(k.layers) for k in graph.layer_kinds}

    def choices(**override) -> dict:
        out = {"embedding": "vocab", "lm_head": "col"}
        for k in graph.layer_kinds:
            for op in k.ops:
                if op.name in CHOICE_NAMES:
                    out[f"{k.name}.{op.name}"] = override.get(op.name, MEGATRON[op.name])
        return out

    second = {"ep": 2} if graph.config.get("num_experts") else {"dp": 2}
    batch = choices(**(TORCH_STYLE_ONLY_BATCH if problem else
                       {"qkv": "row", "attn_core": "batch", "out_proj": "col"}))
    strategies = [("emitted parallelize.py", {"tp": 2, **second}, choices(), {}),
                  ("heads split, KV cache", {"tp": 2, "dp": 2}, choices(), {"kv_cache": 2}),
                  ("batch attention, " + ("rep" if problem else "row") + " qkv, padding",
                   {"tp": 2, **second}, batch, {"padded": "right"}),
                  ("2 pipeline stages", {"tp": 2, "pp": 2}, choices(), {})]
    out = []
    for i, (title, degrees, named, extra) in enumerate(strategies):
        if i and not problem:
            out.append(Case(f"{name}: {title}", degrees, named, kinds, **extra))
            continue
        st = strategy_from_names(degrees, named, 8)
        plan = build_plan(graph, st, Mesh(4, 1), "h100", Workload(batch=8))
        if problem:
            verdict = torch_style_verdict({"runs": False, "reason": problem}, [plan], graph)
            if not verdict["runs"]:
                raise InputError(verdict["reason"])
        code = folder / f"parallelize_{name}_{i}.py"
        code.write_text(plan.code())
        out.append(Case(f"{name}: {title}", {}, {}, None, code=str(code), **extra))
    return out


def _plan_of_tiny_layers(name: str, plan, folder: Path):
    """``plan``, or, when the tiny variant keeps original layers past the 4 the table plans
    (Nemotron-H's keeps layers 0-7 to hold an attention layer), the same compile of the
    config cut to those layers: ``shardc verify`` needs a plan of every layer it runs."""
    from family_matrix import tiny_config

    import shardc
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Workload

    cfg = tiny_config(config_path(name))
    source = getattr(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg,
                     "shardc_source_layers", None) or []
    if not source or max(source) < 4:
        return plan
    graph = load_graph(_cut_config(name, folder, max(source) + 1))
    context = min(4096, int(graph.config.get("max_position_embeddings") or 4096))
    return shardc.compile(graph, mesh="8x1", search="megatron", budget=1,
                          workload=Workload(context=context))


def _verified(name: str, plan, folder: Path) -> str:
    if importlib.util.find_spec("shardc.frontends.tiny_config") is None:
        return "pending (`shardc verify` of a config.json needs the tiny_config merge)"
    if plan is None:
        return "n/a"
    from shardc.cli import main

    plan = _plan_of_tiny_layers(name, plan, folder)
    path = folder / f"plan_{name}.json"
    plan.save(path)
    rc = main(["verify", str(config_path(name)), "--plan", str(path), "--world", "2"])
    return "yes" if rc == 0 else f"no (verify exit {rc})"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> list[dict]:
    from shardc.backends.support import backend_problem
    from shardc.backends.verify import run_suites
    from shardc.frontends.model_file import load_model_file
    from shardc.plan import strategy_code

    folder = tmp_path_factory.mktemp("support")
    rows, suites = [], []
    for title, name in FAMILIES:
        traced, cost, plan = _trace_and_plan(name, folder)
        row = {"family": title, "name": name, "traced": traced, "cost": cost, "plan": plan}
        model_file = write_tiny_model_file(name, folder)
        try:
            tiny, _ = load_model_file(model_file).build(tiny=True)
            problem = backend_problem(tiny)
        except ShardcError as e:
            problem = str(e)
        if row["cost"] != "yes":
            row["backend"] = "n/a (not planned)"
        else:
            try:
                suites.append((str(model_file), _cases(name, model_file, folder, problem)))
            except ShardcError as e:
                row["backend"] = f"no (plan + launch scripts, no parallelize.py): {e}"
        rows.append(row)
    results = {r["name"]: r for r in run_suites(suites, world=4, plan_code=strategy_code)} \
        if suites else {}
    for row in rows:
        if "backend" in row:
            continue
        mine = [r for n, r in results.items() if n.startswith(f"{row['name']}: ")]
        bad = [r for r in mine if r["error"] or r["rel_err"] is None or r["rel_err"] > TOL]
        row["backend"] = "yes" if mine and not bad else \
            "no: " + "; ".join(f"{r['name']}: {(r['error'] or 'logits differ').splitlines()[0]}"
                               for r in bad)
        row["failures"] = bad
    for row in rows:
        row["verified"] = "n/a (no parallelize.py to verify)" \
            if row["backend"].startswith("no (plan") else _verified(row["name"], row["plan"], folder)
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "# Support matrix",
        "",
        "Generated by `tests/test_support_matrix.py` from the public config.json of each family",
        "(`examples/configs/<name>/config.json`); the test fails when this file differs from what",
        "it renders (`SHARDC_UPDATE_DOCS=1 pytest tests/test_support_matrix.py` rewrites it).",
        "",
        "- **traced**: the config's first 4 decoder layers at full width, traced on `meta` and",
        "  passed (the layer pattern of every family repeats within 4 layers);",
        "- **cost-modelled**: that graph planned by `shardc.compile(search=\"megatron\")` on an",
        "  8x1 H100 mesh (decode, context 4096 or the model's maximum if shorter);",
        "- **backend-runnable**: `shardc compile`'s backend check accepts the model, and the tiny",
        "  variant (the one `shardc verify` derives from the config) sharded on 4 gloo ranks -- the",
        "  emitted `parallelize.py` of a tp=2 plan (ep=2 for MoE, else dp=2), a heads split with",
        "  the KV cache, a batch-split attention with row qkv (rep qkv for a family the",
        "  torch-style runtime alone runs) and a padding mask, 2 pipeline",
        f"  stages -- gives the unsharded logits within {TOL:g} (relative); for a model the",
        "  backend cannot run, `shardc compile` writes plan.json (`backend {runs: false, reason}`),",
        "  the reports and both engine launch scripts, and no `parallelize.py`;",
        "- **verified**: `shardc verify <config.json> --plan plan.json --world 2` exits 0.",
        "",
        "| family | config | traced | cost-modelled | backend-runnable | verified | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["family"], f"`{r['name']}`", r["traced"], r["cost"], r["backend"],
                 r["verified"], NOTES.get(r["name"], "")]
        lines.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells)
                     + " |")
    return "\n".join(lines) + "\n"


def test_every_runnable_family_matches_unsharded_logits(matrix):
    for row in matrix:
        assert not row.get("failures"), (row["name"], row["failures"])


def test_support_doc_is_generated(matrix):
    text = render(matrix)
    if os.environ.get("SHARDC_UPDATE_DOCS") == "1":
        DOC.write_text(text)
    assert DOC.exists() and DOC.read_text() == text, (
        "docs/support.md differs from the support matrix the code produces; run "
        "SHARDC_UPDATE_DOCS=1 pytest tests/test_support_matrix.py and commit it")
