"""Rewrite shardc/backends/engine_flags.json from the engines' own argument definitions.

    python tools/refresh_engine_flags.py --vllm ~/src/vllm --sglang ~/src/sglang \
        --trtllm ~/src/TensorRT-LLM --vllm-label "vLLM v0.11.1" --sglang-label "SGLang v0.5.5"

Reads, from source checkouts (nothing is imported or run):

* vLLM: ``vllm/engine/arg_utils.py`` (every ``add_argument("--flag", ...)`` of
  ``EngineArgs.add_cli_args``) and ``vllm/entrypoints/openai/cli_args.py`` (the
  ``add_argument`` calls of ``make_arg_parser`` and one ``--field-name`` per field of the
  ``FrontendArgs`` dataclass, which vLLM turns into flags);
* SGLang: ``python/sglang/srt/server_args.py`` (every ``add_argument`` of
  ``ServerArgs.add_cli_args``);
* TensorRT-LLM: ``tensorrt_llm/commands/serve.py`` (every ``click.option`` of the commands).

Every string literal starting with ``--`` among an ``add_argument`` call's positional
arguments is a flag (aliases included). shardc's tests then check every flag a launch
script writes against this list.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

FLAGS_FILE = Path(__file__).resolve().parents[1] / "shardc" / "backends" / "engine_flags.json"


def add_argument_flags(source: str) -> set[str]:
    """Flags of every ``*.add_argument("--x", "--y", ...)`` call in ``source``."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            for arg in node.args:
                if (isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                        and arg.value.startswith("--")):
                    out.add(arg.value)
    return out


def click_option_flags(source: str) -> set[str]:
    """Flags of every ``click.option("--x", ...)`` decorator in ``source``."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "option"):
            out |= {a.value for a in node.args if isinstance(a, ast.Constant)
                    and isinstance(a.value, str) and a.value.startswith("--")}
    return out


def dataclass_field_flags(source: str, class_name: str) -> set[str]:
    """``--field-name`` for every annotated field of class ``class_name`` in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {"--" + st.target.id.replace("_", "-") for st in node.body
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    return set()


def vllm_flags(root: Path) -> set[str]:
    args = (root / "vllm" / "engine" / "arg_utils.py").read_text()
    cli = (root / "vllm" / "entrypoints" / "openai" / "cli_args.py").read_text()
    return add_argument_flags(args) | add_argument_flags(cli) | dataclass_field_flags(
        cli, "FrontendArgs")


def sglang_flags(root: Path) -> set[str]:
    return add_argument_flags((root / "python" / "sglang" / "srt" / "server_args.py").read_text())


def trtllm_flags(root: Path) -> set[str]:
    return click_option_flags((root / "tensorrt_llm" / "commands" / "serve.py").read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm", type=Path, help="vLLM source checkout")
    p.add_argument("--sglang", type=Path, help="SGLang source checkout")
    p.add_argument("--trtllm", type=Path, help="TensorRT-LLM source checkout")
    p.add_argument("--trtllm-label", default=None, help="version named in the scripts' header")
    p.add_argument("--vllm-label", default=None, help="version named in the scripts' header")
    p.add_argument("--sglang-label", default=None, help="version named in the scripts' header")
    p.add_argument("--out", type=Path, default=FLAGS_FILE)
    a = p.parse_args(argv)
    data = json.loads(a.out.read_text())
    for engine, root, label, read in (("vllm", a.vllm, a.vllm_label, vllm_flags),
                                      ("sglang", a.sglang, a.sglang_label, sglang_flags),
                                      ("trtllm", a.trtllm, a.trtllm_label, trtllm_flags)):
        if root is None:
            continue
        data[engine]["flags"] = sorted(read(root))
        data[engine]["checked_against"] = label or f"{engine} source at {root.resolve()}"
    a.out.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
