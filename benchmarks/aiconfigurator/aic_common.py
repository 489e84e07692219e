"""Shared plumbing of the AIConfigurator side-by-side benchmarks (not part of shardc).

Runs NVIDIA AIConfigurator's CLI from its own virtualenv (``setup_venv.sh``) and shardc's CLI
from the checkout this file lives in, both as subprocesses; caches AIConfigurator's answers
in a JSON file keyed by the exact command (and the model config's content), so re-runs only
recompute shardc's side.

Environment: ``SHARDC_AIC_VENV`` (the AIConfigurator venv, default
``~/.cache/shardc/aic-venv``), ``SHARDC_AIC_WORK`` (generated model folders and AIConfigurator
save dirs, default ``~/.cache/shardc/aic-work``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
AIC_VERSION = "0.12.0"
AIC_VENV = Path(os.environ.get("SHARDC_AIC_VENV", Path.home() / ".cache/shardc/aic-venv"))
WORK = Path(os.environ.get("SHARDC_AIC_WORK", Path.home() / ".cache/shardc/aic-work"))
NICE = ["nice", "-n", "10"]
AIC_TIMEOUT_S = 1800
SHARDC_TIMEOUT_S = 1800
BF16_QUANT = ["--gemm-quant-mode", "bfloat16", "--kvcache-quant-mode", "bfloat16",
              "--fmha-quant-mode", "bfloat16", "--moe-quant-mode", "bfloat16"]


# ---------------------------------------------------------------------------------- files

def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder + rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    """Strict JSON (no NaN/Infinity), sorted keys, atomically."""
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n")


class Cache:
    """AIConfigurator answers keyed by command: ``{"entries": {key: result}}`` in a JSON file."""

    def __init__(self, path: Path, refresh: bool = False):
        self.path = path
        self.entries: dict = {}
        if path.exists() and not refresh:
            self.entries = json.loads(path.read_text()).get("entries", {})
        self.hits = 0
        self.misses = 0

    def get(self, key: str):
        hit = self.entries.get(key)
        if hit is not None:
            self.hits += 1
        return hit

    def put(self, key: str, value) -> None:
        self.misses += 1
        self.entries[key] = value
        self.save()

    def save(self) -> None:
        write_json(self.path, {"aiconfigurator_version": AIC_VERSION, "entries": self.entries})


# ---------------------------------------------------------------------------------- models

def model_is_moe(cfg: dict) -> bool:
    return any(int(cfg.get(k) or 0) > 1 for k in ("num_local_experts", "num_experts",
                                                  "n_routed_experts"))


def _load_example_config(py_path: Path) -> dict:
    """The HF config dict of a shardc example model file (its ``config()``), with the
    ``architectures`` field AIConfigurator dispatches on."""
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location(f"_aic_example_{py_path.stem}", py_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.config()
    d = json.loads(cfg.to_json_string())
    if not d.get("architectures"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        d["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]]
    return d


def model_folder(model: str) -> tuple[Path, dict]:
    """(folder holding a config.json for AIConfigurator's --model-path, the config dict) for
    shardc's MODEL argument (repo-relative): an HF config.json is used as is; an example .py
    file's ``config()`` is written to ``$SHARDC_AIC_WORK/models/<stem>/config.json``, so both
    tools read the same dimensions."""
    path = ROOT / model
    if path.name.endswith(".json"):
        return path.parent, json.loads(path.read_text())
    cfg = _load_example_config(path)
    folder = WORK / "models" / path.stem
    text = json.dumps(cfg, indent=1, sort_keys=True) + "\n"
    target = folder / "config.json"
    if not target.exists() or target.read_text() != text:
        write_atomic(target, text)
    return folder, cfg


def config_digest(folder: Path) -> str:
    return hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()[:16]


def moe_parallel_args(tp: int, ep: int, moe: bool, prefix: str = "") -> list[str]:
    """AIConfigurator's parallel flags for shardc degrees (tp, ep): attention TP ``tp`` and
    attention data-parallel ``ep`` (shardc's ep mesh dim splits the batch outside the expert
    layers), experts TP ``tp`` x EP ``ep`` (Megatron's rule, expert TP = attention TP)."""
    p = f"--{prefix}-" if prefix else "--"
    args = [f"{p}tp-size", str(tp)]
    if moe:
        args += [f"{p}attention-dp-size", str(ep), f"{p}moe-tp-size", str(tp),
                 f"{p}moe-ep-size", str(ep)]
    return args


# ---------------------------------------------------------------------------- AIConfigurator

def aic_exe() -> Path:
    return AIC_VENV / "bin" / "aiconfigurator"


def ensure_aic() -> None:
    """Create the AIConfigurator venv (setup_venv.sh) when it is missing."""
    if not aic_exe().exists():
        subprocess.run(["bash", str(HERE / "setup_venv.sh")], check=True,
                       env={**os.environ, "SHARDC_AIC_VENV": str(AIC_VENV)})


def aic_versions() -> dict:
    ensure_aic()
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            "('aiconfigurator', 'aiconfigurator-core')}))")
    out = subprocess.run([str(AIC_VENV / "bin" / "python"), "-c", code], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def run_aic(subcommand: str, args: list[str]) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, wall s) of ``aiconfigurator cli SUBCOMMAND ARGS`` at nice 10."""
    ensure_aic()
    WORK.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    p = subprocess.run(NICE + [str(aic_exe()), "cli", subcommand, "--no-color", *args],
                       capture_output=True, text=True, timeout=AIC_TIMEOUT_S, cwd=str(WORK))
    return p.returncode, p.stdout, p.stderr, time.perf_counter() - t0


def display_path(text: str) -> str:
    """``text`` with this machine's folders spelled as ``$SHARDC_AIC_VENV``,
    ``$SHARDC_AIC_WORK`` and repo-relative, so cached files do not depend on the machine."""
    text = str(text).replace(str(AIC_VENV), "$SHARDC_AIC_VENV").replace(str(WORK),
                                                                         "$SHARDC_AIC_WORK")
    return text.replace(str(ROOT) + "/", "")


def aic_error_line(stdout: str, stderr: str) -> str:
    """The most telling line of a failed AIConfigurator run."""
    lines = [ln.strip() for ln in (stdout + "\n" + stderr).splitlines() if ln.strip()]
    for ln in reversed(lines):  # the last "Error: ..." / "RuntimeError: ..." line
        if re.match(r"^(Error|\w+Error|\w+Exception)\b.*:", ln):
            return display_path(ln)[:300]
    return display_path(lines[-1] if lines else "no output")[:300]


_FIELD = re.compile(r"^\s*([A-Za-z][A-Za-z ().\-/]*?):\s+(.+?)\s*$")


def parse_estimate_box(stdout: str) -> dict:
    """The fields of ``cli estimate``'s summary box (``TTFT: 85.9 ms`` -> ``{"TTFT": "85.9 ms"}``)
    and its per-op data-source summary (``--detail source``: ``{"generation": "silicon=3, ..."}``)."""
    fields: dict[str, str] = {}
    sources: dict[str, str] = {}
    in_sources = False
    for line in stdout.splitlines():
        if "Data Source Breakdown" in line:
            in_sources = True
            continue
        if in_sources:
            m = re.match(r"^\s{2}(\S.*?)\s+((?:[a-z_]+=\d+,?\s*)+)$", line)
            if m:
                sources[m.group(1)] = m.group(2).strip()
            continue
        m = _FIELD.match(line)
        if m and m.group(1) not in fields:
            fields[m.group(1)] = m.group(2)
    fields_num = {}
    for k, v in fields.items():
        num = re.match(r"^([-0-9.,]+)", v)
        if num:
            try:
                fields_num[k] = float(num.group(1).replace(",", ""))
            except ValueError:
                pass
    return {"fields": fields, "numbers": fields_num, "sources": sources}


def aic_estimate(cache: Cache, folder: Path, args: list[str]) -> dict:
    """AIConfigurator ``cli estimate`` on the model in ``folder`` with ``args`` (cached).
    SILICON database first; when its measured tables do not cover the case, HYBRID (the
    measured tables extended by speed-of-light x empirical factors), recorded as such."""
    key = json.dumps(["estimate", config_digest(folder), args])
    hit = cache.get(key)
    if hit is not None:
        return hit
    result: dict = {"args": args, "model_path": display_path(folder)}
    for mode in ("SILICON", "HYBRID"):
        rc, out, err, wall = run_aic("estimate", ["--model-path", str(folder), *args,
                                                  "--database-mode", mode,
                                                  "--log-level", "ERROR", "--detail", "source"])
        box = parse_estimate_box(out)
        ok = rc == 0 and ("TTFT" in box["numbers"] or "TPOT" in box["numbers"])
        if ok:
            n = box["numbers"]
            result.update(database_mode=mode, wall_s=round(wall, 2),
                          ttft_ms=n.get("TTFT"), tpot_ms=n.get("TPOT"),
                          memory_gb=n.get("Memory (GPU)"),
                          tok_s_per_gpu=n.get("tokens/s/gpu"),
                          tok_s_per_user=n.get("tokens/s/user"),
                          backend=box["fields"].get("Backend"), sources=box["sources"],
                          oom=("OOM" in out) or ("OOM" in err))
            break
        result[f"error_{mode.lower()}"] = aic_error_line(out, err)
    result["run_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cache.put(key, result)
    return result


# ------------------------------------------------------------------------------------ shardc

def shardc_cmd(subcommand: str, args: list[str]) -> list[str]:
    return NICE + [sys.executable, "-m", "shardc.cli", subcommand, *args]


def run_shardc(subcommand: str, args: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of this checkout's ``shardc SUBCOMMAND ARGS``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        p = subprocess.run(shardc_cmd(subcommand, args), capture_output=True, text=True,
                           cwd=str(ROOT), env=env, timeout=SHARDC_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {SHARDC_TIMEOUT_S} s"
    return p.returncode, p.stdout, p.stderr


def shardc_help(subcommand: str) -> str:
    rc, out, err = run_shardc(subcommand, ["--help"])
    return out if rc == 0 else ""


def flag_choices(help_text: str, flag: str) -> list[str] | None:
    """The ``{a,b}`` choices argparse prints for ``flag`` (or the words of an ``a|b|FILE``
    metavar, as ``--kernels silicon|roofline|FILE.npz``); [] for a flag without choices;
    None when the flag does not exist."""
    m = re.search(re.escape(flag) + r"\s+\{([^}]*)\}", help_text)
    if m:
        return [c.strip() for c in m.group(1).split(",")]
    m = re.search(re.escape(flag) + r"[ =]([\w.:-]+(?:\|[\w.:-]+)+)", help_text)
    if m:
        return m.group(1).split("|")
    return [] if re.search(re.escape(flag) + r"\b", help_text) else None


def shardc_error_line(out: str, err: str, rc: int) -> str:
    lines = [ln for ln in (err or out).splitlines() if ln.strip()]
    return f"exit {rc}: " + (lines[-1].strip()[:300] if lines else "no output")


def shardc_revision() -> str:
    """``git describe``-like id of the checkout (short commit, ``+dirty`` if modified)."""
    def git(*a):
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True,
                              text=True).stdout.strip()
    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + ("+dirty" if git("status", "--porcelain", "--", "shardc") else "")


# ---------------------------------------------------------------------------------- numbers

def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)
