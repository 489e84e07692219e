"""The torch-style backend: ``shardc compile --standalone`` emits a ``parallelize.py`` on
torch's own parallel API (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` and shardc's few inlined styles) that imports only torch.

* numerics: one 4-rank gloo launch runs the emitted files of tiny Llama (Megatron tp=4,
  replicated attention + hidden ffn2, batch-split attention, dp x tp, sequence parallelism,
  KV cache), tiny Mixtral (ep x tp, ep=4, replicated experts, sp; attention data parallel
  with the experts tensor- or expert-parallel over every rank) and tiny DeepSeek-V3 (MLA
  tp=4, ep=4, batch-split MLA, sp), and the files ``shardc compile --standalone`` writes;
  logits equal the unsharded model's;
* parameter placements: every parameter's DTensor placements (per SPMD mesh dim; a plain
  tensor or an absent mesh dim is ``R``) and local shape equal plan.json's ``params`` rows;
* imports: the emitted file imports only torch, ``import shardc.runtime`` pulls no
  transformers / onnx / gymnasium / matplotlib / shardc.backends;
* plans the path does not cover yet are refused (exit 2) naming what;
* families from their config.json (Qwen2.5 biases, Qwen3-MoE q/k norms, Gemma-2, DeepSeek-V2-
  Lite MLA without q_lora) run the model's own attention and routing under the styles.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_backend_gloo import (
    DEEPSEEK,
    DENSE,
    DS_LAYERS,
    DS_MEGATRON,
    LLAMA,
    MIXTRAL,
    MOE,
    REP_ATTN,
    TOL,
    D,
    M,
    _with,
    ruff_clean,
)
from torch.distributed.tensor import DTensor

from shardc.backends.verify import Case, run_suites

ROOT = Path(__file__).resolve().parents[1]
TINY_DEEPSEEK = str(ROOT / "examples" / "tiny_deepseek_v3.py")  # DEEPSEEK's tiny_model()
BATCH_ATTN = {"qkv": "rep", "attn_core": "batch", "out_proj": "col"}

# name -> (model file, degrees, choices); layer kinds come from the tiny graph
CASES = {
    "llama megatron tp4": (LLAMA, {"tp": 4}, DENSE),
    "llama replicated attention, ffn2 hidden tp4": (
        LLAMA, {"tp": 4}, _with(DENSE, D, ffn2="col", **REP_ATTN)),
    "llama qkv rep, heads, out_proj rep tp4": (
        LLAMA, {"tp": 4}, _with(DENSE, D, qkv="rep", out_proj="rep")),
    "llama batch attention, hidden embedding, row lm_head tp4": (
        LLAMA, {"tp": 4}, _with(DENSE, D, embedding="hidden", lm_head="row", **BATCH_ATTN)),
    "llama dp2 tp2 ffn1 row": (LLAMA, {"tp": 2, "dp": 2}, _with(DENSE, D, ffn1="row")),
    "mixtral ep2 tp2 megatron": (MIXTRAL, {"ep": 2, "tp": 2}, MOE),
    "mixtral ep4": (MIXTRAL, {"ep": 4}, MOE),
    # attention data parallel, the experts split their own way (GatheredExperts)
    "mixtral dp_attn4 moe_tp4": (MIXTRAL, {"ep": 4, "moe_tp": 4}, MOE),
    "mixtral tp2 dp_attn2 moe_tp4": (MIXTRAL, {"tp": 2, "ep": 2, "moe_tp": 4}, MOE),
    "mixtral tp2 dp_attn2 moe_ep4": (MIXTRAL, {"tp": 2, "ep": 2, "moe_ep": 4}, MOE),
    "mixtral tp4 moe_ep4": (MIXTRAL, {"tp": 4, "moe_ep": 4}, MOE),
    # mixed: moe_tp=2 x moe_ep=2 on the experts mesh (the ep x tp ranks re-factored)
    "mixtral dp_attn4 moe_tp2 moe_ep2": (MIXTRAL, {"ep": 4, "moe_tp": 2}, MOE),
    "mixtral tp4 moe_tp2 moe_ep2": (MIXTRAL, {"tp": 4, "moe_tp": 2}, MOE),
    # a shared expert beside the re-split experts, on the rank's own rows
    "deepseek dp_attn4 moe_tp4, shared expert": (DEEPSEEK, {"ep": 4, "moe_tp": 4}, DS_MEGATRON),
    "deepseek tp2 dp_attn2 moe_ep4, shared expert": (
        DEEPSEEK, {"tp": 2, "ep": 2, "moe_ep": 4}, DS_MEGATRON),
    "mixtral ep2 tp2 replicated experts, batch attention": (
        MIXTRAL, {"ep": 2, "tp": 2},
        _with(MOE, M, expert_ffn1="rep", expert_ffn2="rep", **BATCH_ATTN)),
    "llama megatron + sequence parallel tp4": (LLAMA, {"tp": 4, "sp": 4}, DENSE),
    "llama sp tp4: batch attention, row ffn1, hidden embedding": (
        LLAMA, {"tp": 4, "sp": 4},
        _with(DENSE, D, qkv="rep", attn_core="batch", out_proj="row", ffn1="row", ffn2="col",
              embedding="hidden", lm_head="row")),
    "llama sp dp2 tp2: qkv row, replicated embedding and lm_head": (
        LLAMA, {"tp": 2, "sp": 2, "dp": 2},
        _with(DENSE, D, qkv="row", out_proj="col", embedding="rep", lm_head="rep")),
    "mixtral sp ep2 tp2, replicated experts": (
        MIXTRAL, {"tp": 2, "sp": 2, "ep": 2}, _with(MOE, M, expert_ffn1="rep", expert_ffn2="rep")),
    "deepseek MLA megatron tp4": (DEEPSEEK, {"tp": 4}, DS_MEGATRON),
    "deepseek MLA sp tp4, replicated experts": (
        DEEPSEEK, {"tp": 4, "sp": 4}, _with(DS_MEGATRON, M, expert_ffn1="rep", expert_ffn2="rep")),
    "deepseek ep4, replicated dense attention": (
        DEEPSEEK, {"ep": 4}, _with(DS_MEGATRON, D, **REP_ATTN)),
    "deepseek ep2 tp2 batch-split MLA, shared rep": (
        DEEPSEEK, {"ep": 2, "tp": 2},
        _with(_with(DS_MEGATRON, D, **BATCH_ATTN), M, shared_ffn1="rep", shared_ffn2="rep",
              **BATCH_ATTN)),
}
# families from their config.json (tiny variants): name -> (directory, degrees); Megatron
FAMILIES = {"qwen2.5 (q/k/v biases) tp2 dp2": ("qwen2_5_7b", {"tp": 2, "dp": 2}),
            "qwen3-moe (per-head q/k norms) tp2 ep2": ("qwen3_30b_a3b", {"tp": 2, "ep": 2}),
            "gemma-2 (softcapping, sliding window, tied lm_head) tp2 dp2": (
                "gemma2_9b", {"tp": 2, "dp": 2}),
            "deepseek-v2-lite (MLA without q_lora, greedy routing) tp2 ep2": (
                "deepseek_v2_lite", {"tp": 2, "ep": 2})}
MEGATRON = {"qkv": "col", "attn_core": "heads", "out_proj": "row", "ffn1": "col", "ffn2": "row",
            "router": "rep", "expert_ffn1": "col", "expert_ffn2": "row", "shared_ffn1": "col",
            "shared_ffn2": "row"}
# covered plans whose default parallelize.py (importing shardc.runtime) runs too
DEFAULT_FILE_CASES = ["llama megatron tp4", "mixtral ep2 tp2 megatron", "deepseek MLA megatron tp4",
                      "llama megatron + sequence parallel tp4", "mixtral tp2 dp_attn2 moe_tp4"]
# (case name, base case, Case options): the same emitted file under a cache / padding
VARIANTS = [("llama megatron tp4, KV cache", "llama megatron tp4", {"kv_cache": 2}),
            ("mixtral ep2 tp2, padding mask", "mixtral ep2 tp2 megatron", {"padded": "right"}),
            ("deepseek MLA tp4, KV cache", "deepseek MLA megatron tp4", {"kv_cache": 2}),
            ("llama sp tp4, left padding (masks of the tp rank's rows)",
             "llama megatron + sequence parallel tp4", {"padded": "left"}),
            ("llama sp tp4, KV cache", "llama megatron + sequence parallel tp4", {"kv_cache": 2}),
            ("llama batch attention tp4, KV cache",
             "llama batch attention, hidden embedding, row lm_head tp4", {"kv_cache": 2}),
            ("mixtral ep4, KV cache", "mixtral ep4", {"kv_cache": 2}),
            ("mixtral dp_attn4 moe_tp4, KV cache", "mixtral dp_attn4 moe_tp4", {"kv_cache": 2}),
            ("mixtral tp2 dp_attn2 moe_tp4, left padding", "mixtral tp2 dp_attn2 moe_tp4",
             {"padded": "left"}),
            ("deepseek sp batch-split MLA, padding mask",
             "deepseek ep2 tp2 batch-split MLA, shared rep", {"padded": "right"})]
# what ``shardc compile --standalone`` writes, run as is: name -> (model file, --degrees)
CLI_CASES = {"llama: shardc compile --mesh 4x1 --degrees tp=4 --standalone": (LLAMA, "tp=4"),
             "mixtral: shardc compile --mesh 4x1 --degrees ep=2,tp=2 --standalone": (
                 MIXTRAL, "ep=2,tp=2"),
             "deepseek: shardc compile --mesh 4x1 --degrees tp=4 --standalone": (
                 TINY_DEEPSEEK, "tp=4"),
             "mixtral: shardc compile --mesh 4x1 --degrees dp_attn=4,moe_tp=4 --standalone": (
                 MIXTRAL, "dp_attn=4,moe_tp=4")}


def build(model_file: str, degrees: dict, choices: dict | None):
    """plan of the tiny graph of ``model_file`` (``choices`` None: Megatron's for every op)."""
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    graph = load_graph(model_file, tiny=True)
    if choices is None:
        choices = {"embedding": "vocab", "lm_head": "col"}
        choices.update({f"{k.name}.{o.name}": MEGATRON[o.name] for k in graph.layer_kinds
                        for o in k.ops if o.name in MEGATRON})
    st = strategy_from_names(degrees, choices, 8)
    return build_plan(graph, st, Mesh(st.degrees.world, 1), "h100",
                      Workload(batch=8, context=512))


def config_file(directory: str) -> str:
    return str(ROOT / "examples" / "configs" / directory / "config.json")


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> dict[str, tuple]:
    """name -> (plan, path of its standalone parallelize.py); plus the CLI's file."""
    tmp = tmp_path_factory.mktemp("standalone")
    out = {}
    for i, (name, (model, degrees, choices)) in enumerate(CASES.items()):
        plan = build(model, degrees, choices)
        path = tmp / f"case{i}_parallelize.py"
        path.write_text(plan.code(standalone=True))
        out[name] = (plan, path)
    for name in DEFAULT_FILE_CASES:  # the default parallelize.py: the same plans, shardc.runtime
        path = tmp / f"default{len(out)}_parallelize.py"
        path.write_text(out[name][0].code())
        out[f"{name} (default file)"] = (out[name][0], path)
    for i, (name, (directory, degrees)) in enumerate(FAMILIES.items()):
        path = tmp / f"family{i}_parallelize.py"
        plan = build(config_file(directory), degrees, None)
        path.write_text(plan.code(standalone=True))
        out[name] = (plan, path)
    for i, (name, (model, degrees)) in enumerate(CLI_CASES.items()):
        cli_out = tmp / f"cli{i}"
        r = subprocess.run([sys.executable, "-m", "shardc.cli", "compile", model, "--mesh", "4x1",
                            "--degrees", degrees, "--search", "megatron", "--standalone",
                            "--quiet", "--out", str(cli_out)], capture_output=True, text=True,
                           cwd=ROOT)
        assert r.returncode == 0, r.stderr
        out[name] = (None, cli_out / "parallelize.py")
    return out


@pytest.fixture(scope="module")
def gloo_results(emitted):
    ruff_clean([str(p) for _, p in emitted.values()])
    model_of = {name: CASES[name][0] for name in CASES}
    model_of.update({f"{n} (default file)": CASES[n][0] for n in DEFAULT_FILE_CASES})
    model_of.update({name: model for name, (model, _) in CLI_CASES.items()})
    suites = []
    for model in (LLAMA, MIXTRAL, DEEPSEEK, TINY_DEEPSEEK):
        cases = [Case(n, {}, {}, None, code=str(emitted[n][1]))
                 for n in emitted if model_of.get(n) == model]
        cases += [Case(n, {}, {}, None, code=str(emitted[base][1]), **opts)
                  for n, base, opts in VARIANTS if model_of[base] == model]
        suites.append((model, cases))
    for name, (directory, degrees) in FAMILIES.items():
        suites.append((config_file(directory),
                       [Case(name, {}, {}, None, code=str(emitted[name][1]))], degrees))
    return {r["name"]: r for r in run_suites(suites, world=4)}


@pytest.mark.parametrize("name", [*CASES, *(v[0] for v in VARIANTS), *CLI_CASES, *FAMILIES,
                                  *(f"{n} (default file)" for n in DEFAULT_FILE_CASES)])
def test_standalone_logits_match_unsharded(gloo_results, name):
    r = gloo_results[name]
    assert r["error"] is None, r["error"]
    assert r["rel_err"] <= TOL, r


def _imported_modules(src: str) -> set[str]:
    """Every module ``src`` imports, except the one lazy import of the ``--bench`` entry's
    HF builder (``_hf_auto``: transformers, for ``--config`` only)."""
    mods = set()
    tree = ast.parse(src)
    lazy = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
            and f.name == "_hf_auto" for n in ast.walk(f)}
    for node in ast.walk(tree):
        if id(node) in lazy:
            continue
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mods.add(node.module)
    return mods


# "imports only torch": torch and the standard library (the --bench entry's argparse & co)
TORCH_ONLY = {"torch", "__future__"} | set(sys.stdlib_module_names)


def test_standalone_imports_only_torch(emitted):
    for name, (_, path) in emitted.items():
        mods = _imported_modules(path.read_text())
        if name.endswith("(default file)"):  # torch + the torch-only runtime
            assert mods == {"torch", "torch.distributed.device_mesh", "shardc.runtime",
                            "shardc.fingerprint"}, mods
            assert "parallelize_module(layers[i], tp_mesh, {" in path.read_text()
            continue
        assert {m.split(".")[0] for m in mods} <= TORCH_ONLY, (name, mods)


def _plan_entries(src: str) -> list[dict[str, str]]:
    """The dict literals passed to ``parallelize_module``: {module suffix: style class}."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "parallelize_module" \
                and len(node.args) == 3 and isinstance(node.args[2], ast.Dict):
            out.append((node.lineno, {k.value: v.func.id
                                      for k, v in zip(node.args[2].keys, node.args[2].values)}))
    return [entries for _, entries in sorted(out)]


def test_megatron_file_reads_as_colwise_rowwise_plans(emitted):
    src = emitted[next(iter(CLI_CASES))][1].read_text()
    layer, top = _plan_entries(src)
    assert layer == {"self_attn.q_proj": "ColwiseParallel", "self_attn.k_proj": "ColwiseParallel",
                     "self_attn.v_proj": "ColwiseParallel", "self_attn.o_proj": "RowwiseParallel",
                     "mlp.gate_proj": "ColwiseParallel", "mlp.up_proj": "ColwiseParallel",
                     "mlp.down_proj": "RowwiseParallel"}
    assert top == {"model.embed_tokens": "RowwiseParallel", "lm_head": "ColwiseParallel"}
    # the collective each entry implies, from the contract's walk
    assert "'self_attn.o_proj': RowwiseParallel(),  # out_proj row: all_reduce P->R" in src
    assert "# lm_head col: all_gather S(1)->R" in src
    mla = emitted[list(CLI_CASES)[2]][1].read_text()
    assert "'self_attn.q_b_proj': ColwiseParallel(),  # qkv col: no collective" in mla
    assert "'self_attn.kv_b_proj': ColwiseParallel()" in mla and "q_a_proj'" not in mla
    moe = emitted[list(CLI_CASES)[1]][1].read_text()
    assert "ExpertParallel(tp_split=True)" in moe and "uneven all_to_all_single" in moe
    split = emitted[list(CLI_CASES)[3]][1].read_text().split("\ndef parallelize(")[1]
    assert "GatheredExperts(experts='experts', " in split and "split='tp'" in split
    assert "ExpertParallel(" not in split and "all_gather of the tokens over ep=4" in split


def test_runtime_import_pulls_no_heavy_package():
    code = ("import sys, shardc.runtime\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'onnx', "
            "'gymnasium', 'matplotlib') or m.startswith('shardc.backends'))\n"
            "print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def _spelled(p, dims: list[str]) -> list[str]:
    """Placements of parameter ``p`` per SPMD dim as plan.json spells them."""
    got = dict(zip(p.device_mesh.mesh_dim_names, p.placements)) if isinstance(p, DTensor) else {}
    out = []
    for d in dims:
        pl = got.get(d)
        out.append(f"S({pl.dim % p.ndim})" if pl is not None and pl.is_shard() else "R")
    return out


@pytest.mark.parametrize("name", ["llama megatron tp4", "llama dp2 tp2 ffn1 row",
                                  "llama batch attention, hidden embedding, row lm_head tp4",
                                  "mixtral ep2 tp2 megatron", "mixtral ep4",
                                  "mixtral ep2 tp2 replicated experts, batch attention",
                                  "deepseek MLA megatron tp4", "deepseek ep2 tp2 batch-split MLA, shared rep",
                                  "llama megatron + sequence parallel tp4",
                                  "mixtral sp ep2 tp2, replicated experts",
                                  "mixtral dp_attn4 moe_tp2 moe_ep2",
                                  "mixtral tp4 moe_tp2 moe_ep2"])
def test_parameter_placements_equal_plan_rows(emitted, name):
    """On 4 fake ranks: each parameter's placements and local shape == its plan.json row."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardc.backends.verify import _build, _load_code

    plan, path = emitted[name]
    code = _load_code(str(path))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = _build(CASES[name][0], 8, 8)[0]
        code.parallelize(model)
        assert_placements_match(model, plan)
    finally:
        dist.destroy_process_group()


def assert_placements_match(model, plan) -> None:
    """Every parameter's placements and local shape == its plan.json row; some are sharded."""
    dims = plan.strategy().degrees.spmd_dims()
    rows = {r["fqn"]: r for r in plan.params}
    params = dict(model.named_parameters())
    assert set(params) == set(rows)
    sharded = 0
    for fqn, p in params.items():  # a mixed split's experts: their own mesh's dims
        assert _spelled(p, rows[fqn].get("mesh_dims") or dims) == rows[fqn]["placements"], fqn
        local = p.to_local() if isinstance(p, DTensor) else p
        assert list(local.shape) == rows[fqn]["local_shape"], fqn
        sharded += "S(" in str(rows[fqn]["placements"])
    assert sharded > 0


def test_apply_plan_driver_places_like_the_plan():
    """``shardc.runtime.apply_plan`` with a dict of styles (Megatron on ep=2 x tp=2)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardc.backends.verify import _build
    from shardc.runtime import ExpertParallel, apply_plan, make_mesh

    plan = build(MIXTRAL, {"ep": 2, "tp": 2}, MOE)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = _build(MIXTRAL, 8, 8)[0]
        attention = {f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"}
        styles = {"layer_kinds": plan.layer_kind_map(),
                  "layers": {M: {**attention, "self_attn.o_proj": RowwiseParallel()}},
                  "experts": {M: ExpertParallel(tp_split=True)},
                  "model": {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                            "lm_head": ColwiseParallel(output_layouts=Replicate())}}
        apply_plan(model, styles, make_mesh((2, 2), ("ep", "tp")))
        assert_placements_match(model, plan)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("degrees, choices, style", [
    ({"tp": 2, "sp": 2}, _with(DENSE, D, qkv="rep"), "CoreRowsAttention(core_layouts=Replicate()"),
    ({"tp": 4}, _with(DENSE, D, qkv="row", attn_core="batch"),
     "CoreRowsAttention(core_layouts=Shard(0)"),
])
def test_formerly_uncovered_attention_plans_get_torch_files(degrees, choices, style):
    """Plans the first runtime used to take (issue 20): the core runs on other rows than
    q/k/v read; both forms of parallelize.py use torch's styles (numerics:
    :mod:`test_styles_coverage`)."""
    plan = build(LLAMA, degrees, choices)
    assert style in plan.code(standalone=True)
    assert {m for m in _imported_modules(plan.code()) if m.startswith("shardc")} == \
        {"shardc.runtime", "shardc.fingerprint"}  # the runtime and the model check


def test_formerly_uncovered_experts_and_gpt2_stages_get_torch_files(tmp_path):
    plan = build(MIXTRAL, {"ep": 2, "tp": 2, "sp": 2}, _with(MOE, M, expert_ffn2="col"))
    assert "chain=('col', 'col'), token_rows=True)" in plan.code(standalone=True)
    # pipeline stages of GPT-2's layout (transformer.h, learned positions, tied lm_head)
    gpt2 = str(ROOT / "examples" / "configs" / "gpt2" / "config.json")
    r = subprocess.run([sys.executable, "-m", "shardc.cli", "compile", gpt2, "--mesh", "4x1",
                        "--search", "megatron", "--degrees", "tp=2,pp=2", "--context", "512",
                        "--standalone", "--quiet", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    src = (tmp_path / "o" / "parallelize.py").read_text()
    assert {m.split(".")[0] for m in _imported_modules(src)} <= TORCH_ONLY
    assert "layers_path='transformer.h'," in src and "positions=('transformer.wpe',)," in src


def test_layer_kinds_of_deepseek_plan_cover_both_kinds(emitted):
    plan, path = emitted["deepseek MLA megatron tp4"]
    assert plan.layer_kind_map() == DS_LAYERS
    src = path.read_text()
    assert src.count("for i in LAYER_KINDS[") == 2 and "'self_attn.kv_b_proj': ColwiseParallel()" in src
    assert json.loads(json.dumps(plan.to_dict()))  # strict JSON round trip


def test_standalone_onnx_is_refused_before_anything(tmp_path, capsys):
    from shardc.cli import main

    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"not read")
    rc = main(["compile", str(onnx), "--mesh", "2x1", "--standalone", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err == ("shardc: error: --standalone: an ONNX model gets no parallelize.py "
                               "(no torch module)\n")
    assert not (tmp_path / "o").exists()


def _walk_counts(plan) -> Counter:
    """Collectives of one forward as the cost model charges them (contract walk)."""
    from shardc.ir.contract import BRANCHES, branch_collectives
    from shardc.ir.strategy import residual_placement

    st = plan.strategy()
    res = residual_placement(st.degrees)
    want: Counter = Counter()
    for kind, layers in plan.layer_kind_map().items():
        for branch, ops in BRANCHES.items():
            if all(f"{kind}.{o}" in st.choices for o in ops):
                cs = [st.choices[f"{kind}.{o}"] for o in ops]
                for *_, coll in branch_collectives(ops, cs, res, res):
                    want[coll] += len(layers)
    for op, start, end in (("embedding", "R", res), ("lm_head", res, "R")):
        for *_, coll in branch_collectives((op,), [st.choices[op]], start, end):
            want[coll] += 1
    return want


@pytest.mark.parametrize("name", ["llama megatron tp4", "llama megatron + sequence parallel tp4",
                                  "llama batch attention, hidden embedding, row lm_head tp4"])
def test_collectives_run_are_the_walks(emitted, name):
    """On 4 fake ranks one forward of the standalone model issues exactly the collectives
    the cost model charges (CommDebugMode): under sequence parallelism one all-gather per
    branch, not one per projection."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardc.backends.verify import _build, _load_code

    names = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}
    plan, path = emitted[name]
    code = _load_code(str(path))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model, ids = _build(CASES[name][0], 8, 8)
        model = code.parallelize(model)
        with torch.no_grad(), CommDebugMode() as cm:
            model(ids)
        got: Counter = Counter()
        for op, n in cm.get_comm_counts().items():
            got[names[str(op).split(".")[-1].split("'")[0]]] += n
    finally:
        dist.destroy_process_group()
    assert got == _walk_counts(plan) and sum(got.values()) > 0, got


@pytest.mark.parametrize("standalone", [False, True])
def test_hostile_names_stay_data_in_torch_style_files(tmp_path, monkeypatch, standalone):
    """Layer-kind and model names from a hand-edited plan.json reach the torch-style file
    only as literals and one-line comments: it parses to imports, runtime definitions,
    literal data and ``parallelize``; importing it runs nothing; the names round-trip."""
    from test_security import PAYLOADS, assert_inert

    import shardc

    plan = build(LLAMA, {"tp": 2, "dp": 2}, DENSE)
    for i, payload in enumerate(PAYLOADS):
        d = json.loads(json.dumps(plan.to_dict()))
        d["model"]["name"] = d["mesh"]["hardware"] = payload
        old = d["layer_kinds"][0]["name"]
        d["layer_kinds"][0]["name"] = payload
        for o in d["ops"]:
            if o["layer_kind"] == old:
                o["layer_kind"], o["name"] = payload, payload + o["name"][len(old):]
        path = tmp_path / f"plan{i}.json"
        path.write_text(json.dumps(d))
        src = shardc.load_plan(path).code(standalone=standalone)
        assert "parallelize_module(layers[i], tp_mesh, {" in src
        if not standalone:
            module = assert_inert(src, tmp_path, monkeypatch)
        else:
            tree = ast.parse(src)
            kinds = {type(s).__name__ for s in tree.body
                     if not (isinstance(s, ast.If) and ast.unparse(s.test)
                             == "__name__ == '__main__'")}  # the --bench guard
            assert kinds <= {"Expr", "Import", "ImportFrom", "Assign", "FunctionDef", "ClassDef"}
            assert sum(isinstance(s, ast.Expr) for s in tree.body) == 1 and src.isascii()
            for stmt in tree.body:
                if isinstance(stmt, ast.Assign) and stmt.targets[0].id.isupper():
                    assert not any(isinstance(n, ast.Call) for n in ast.walk(stmt.value))
            gen = tmp_path / f"gen{i}.py"
            gen.write_text(src)
            monkeypatch.chdir(tmp_path)
            spec = importlib.util.spec_from_file_location(f"hostile{i}", gen)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            assert not (tmp_path / "PWNED").exists()
        assert payload in module.LAYER_KINDS and payload in module.__doc__


@pytest.mark.parametrize("model_file, degrees, choices", [(LLAMA, {"tp": 4}, None),
                                                          (MIXTRAL, {"ep": 2, "tp": 2}, MOE)])
def test_plan_apply_runs_the_emitted_parallelize(model_file, degrees, choices):
    """``Plan.apply`` is the emitted parallelize.py: a covered plan's model comes back with
    torch's styles applied (every parameter placed as plan.json says)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardc.backends.verify import _build
    from shardc.runtime import make_mesh

    plan = build(model_file, degrees, choices)
    assert "parallelize_module" in plan.code()  # the torch-style file
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = _build(model_file, 8, 8)[0]
        shape, names = plan.strategy().degrees.logical_mesh()
        plan.apply(model, make_mesh(shape, names))
        assert_placements_match(model, plan)
        q_proj = model.model.layers[0].self_attn.q_proj
        hooks = [getattr(h, "func", h) for h in (*q_proj._forward_pre_hooks.values(),
                                                  *q_proj._forward_hooks.values())]
        origins = {getattr(h, "__module__", "") for h in hooks}
        assert any(o.startswith("torch.distributed.tensor") for o in origins), origins
        assert not any(o.startswith("shardc.backends") for o in origins), origins
    finally:
        dist.destroy_process_group()
