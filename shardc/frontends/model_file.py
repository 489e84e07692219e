"""Load a model description: a ``.py`` model file (SPEC section 5) or an HF ``config.json``.

A model file defines ``build_model() -> nn.Module`` and ``example_inputs() -> tuple`` and
optionally ``tiny_model()`` / ``tiny_inputs()``; a ``build_model`` that takes ``num_layers``
(build the first ``num_layers`` decoder layers only) lets ``load_graph`` trace a reduced
depth. It is imported by path under a private
module name; its directory is put first on ``sys.path`` so that sibling helpers (e.g.
``examples/gpt_moe.py``) import, and helpers from that folder that an earlier load in the
same process imported are imported afresh (an edited helper is never served stale). A ``config.json`` is built with
``AutoModelForCausalLM.from_config`` on the ``meta`` device in bfloat16 (sdpa attention,
``grouped_mm`` experts); its ``tiny_model()`` is built from
:func:`shardc.frontends.tiny_config.tiny_config` (same architecture and layer pattern, small
shapes that ``tiny_degrees`` divide) on CPU in float32 with seeded weights. Every failure is an :class:`InputError` with one line that names
the file (and, when the model itself raises, the model's message and file:line).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from shardc.errors import InputError
from shardc.frontends.imports import forget_folder_modules, recording_imports, user_code

if TYPE_CHECKING:
    from transformers import PretrainedConfig
from shardc.text import clean_text
from shardc.validate import loads_strict_json


@dataclass
class ModelSource:
    """What a model file provides. ``build_model`` / ``tiny_model`` return an ``nn.Module``."""

    name: str
    source: str
    build_model: Callable[[], torch.nn.Module]
    example_inputs: Callable[[], tuple]
    tiny_model: Callable[[], torch.nn.Module] | None = None
    tiny_inputs: Callable[[], tuple] | None = None
    notes: list[str] = field(default_factory=list)  # one line each: how the model was read
    checkpoint: dict | None = None  # a config.json's quantization_config (hf_types)

    def build(self, tiny: bool = False) -> tuple[torch.nn.Module, tuple]:
        """Build (model, example inputs); ``tiny`` uses ``tiny_model`` when the file has one.
        Exceptions raised by the model's own code become one-line :class:`InputError`."""
        make = self.tiny_model if tiny and self.tiny_model is not None else self.build_model
        inputs = self.tiny_inputs if tiny and self.tiny_inputs is not None else self.example_inputs
        model = _call_user(make, self.source, "building the model")
        args = _call_user(inputs, self.source, "making example inputs")
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"{self.source}: {make.__name__}() returned "
                             f"{type(model).__name__}, expected a torch.nn.Module")
        if isinstance(args, torch.Tensor):
            args = (args,)
        if not isinstance(args, (tuple, list)) or not all(isinstance(a, torch.Tensor) for a in args):
            raise InputError(f"{self.source}: example inputs must be a tuple of tensors")
        return model, tuple(args)


def _where(exc: BaseException) -> str:
    """file:line of the innermost frame of the exception (the model's own code)."""
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return "?"
    shardc_dir = str(Path(__file__).resolve().parents[1])
    for frame in reversed(tb):  # the model's own frame, not importlib's or shardc's
        if not frame.filename.startswith(("<", shardc_dir)):
            return f"{frame.filename}:{frame.lineno}"
    return f"{tb[-1].filename}:{tb[-1].lineno}"


def _call_user(fn: Callable, source: str, what: str):
    try:
        with recording_imports(), user_code(source, f"{what} ({fn.__name__}())"):
            return fn()
    except InputError:
        raise
    except Exception as e:  # the model's own error: one line with its message and location
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise InputError(f"{source}: {what} failed: {type(e).__name__}: {msg} "
                         f"(at {_where(e)})") from e


def load_model_file(path: str | Path, tiny_degrees: dict | None = None) -> ModelSource:
    """Load a ``.py`` model file or an HF ``config.json`` into a :class:`ModelSource`.
    ``tiny_degrees`` ({tp, ep, pp, dp}): degrees a config.json's tiny variant must admit
    (a ``.py`` file's own ``tiny_model()`` ignores them)."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such file")
    if not p.is_file():
        raise InputError(f"{path}: not a file")
    if p.suffix == ".py":
        return _load_python(p)
    if p.suffix == ".json":
        return _load_hf_config(p, tiny_degrees)
    raise InputError(f"{path}: unsupported model file (expected .py, .onnx or config.json)")


def _load_python(p: Path) -> ModelSource:
    digest = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:10]
    mod_name = f"shardc_model_{p.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise InputError(f"{p}: cannot import as a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = str(p.resolve().parent)
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)  # the model's own helpers win, as under `python model.py`
    forget_folder_modules(Path(folder))
    # registered before it runs, as the import system does: dataclasses, pickling and
    # typing look the defining module up in sys.modules while the file executes
    sys.modules[mod_name] = module
    try:
        with recording_imports(), user_code(str(p), "importing the model file"):
            spec.loader.exec_module(module)
    except InputError:
        sys.modules.pop(mod_name, None)
        raise
    except (SyntaxError, ValueError, UnicodeDecodeError) as e:
        sys.modules.pop(mod_name, None)
        if isinstance(e, SyntaxError) and e.lineno is not None:
            raise InputError(f"{p}:{e.lineno}: syntax error: {e.msg}") from e
        reason = e.msg if isinstance(e, SyntaxError) else str(e).splitlines()[0]
        raise InputError(f"{p}: not a readable Python source file ({reason})") from e
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise InputError(f"{p}: importing failed: {type(e).__name__}: {e} (at {_where(e)})") from e
    for required in ("build_model", "example_inputs"):
        if not callable(getattr(module, required, None)):
            raise InputError(f"{p}: defines no {required}() (a model file needs build_model() "
                             "and example_inputs())")
    return ModelSource(
        name=p.stem,
        source=str(p),
        build_model=module.build_model,
        example_inputs=module.example_inputs,
        tiny_model=getattr(module, "tiny_model", None),
        tiny_inputs=getattr(module, "tiny_inputs", None),
    )


_CODE_KEYS = ("auto_map", "trust_remote_code")  # config.json keys naming custom code


def _load_hf_config(p: Path, tiny_degrees: dict | None = None) -> ModelSource:
    try:
        data = loads_strict_json(p.read_text())  # NaN / Infinity are not numbers here
    except (OSError, ValueError) as e:
        raise InputError(f"{p}: not a readable JSON file: {e}") from e
    if not isinstance(data, dict) or "model_type" not in data:
        raise InputError(f"{p}: not an HF config.json (no 'model_type' key)")
    from shardc.frontends.config_checks import check_shape_fields

    check_shape_fields(data, str(p))  # before HF or torch sees a size
    from transformers import AutoConfig

    # a config.json is data: keys that point transformers at custom code (auto_map ->
    # module.Class, trust_remote_code) are dropped, so nothing is imported or run for it
    data = {k: v for k, v in data.items() if k not in _CODE_KEYS}
    from shardc.frontends.hf_types import checkpoint_format, known_model_type

    data, note = known_model_type(data, str(p))
    checkpoint = checkpoint_format(data)
    try:
        config = AutoConfig.for_model(**data)
    except Exception as e:  # the reason on the one line (HF's texts span several lines)
        reason = " ".join(str(e).split())
        raise InputError(f"{p}: HF cannot read this config: {type(e).__name__}: "
                         f"{clean_text(reason)}") from e

    def build_model(num_layers: int | None = None) -> torch.nn.Module:
        from shardc.frontends.hf_build import build_causal_lm

        return build_causal_lm(config, num_layers=num_layers)

    def example_inputs() -> tuple:
        return _token_ids(config)

    def tiny() -> PretrainedConfig:
        from shardc.frontends.tiny_config import tiny_config

        return tiny_config(config, tiny_degrees)

    def tiny_model() -> torch.nn.Module:
        from shardc.frontends.hf_build import build_causal_lm

        return build_causal_lm(tiny(), device="cpu", dtype=torch.float32)

    def tiny_inputs() -> tuple:
        return _token_ids(tiny())

    name = data.get("_name_or_path") or (p.parent.name if p.name == "config.json" else p.stem)
    name = clean_text(Path(str(name)).name) or clean_text(p.stem) or "model"
    return ModelSource(name=name, source=str(p),
                       build_model=build_model, example_inputs=example_inputs,
                       tiny_model=tiny_model, tiny_inputs=tiny_inputs,
                       notes=[note] if note else [], checkpoint=checkpoint)


def _token_ids(config) -> tuple:
    """One deterministic [1, 16] int64 batch of token ids below the config's vocab (a
    multimodal config's text model's vocab)."""
    g = torch.Generator().manual_seed(0)
    vocab = int(getattr(config.get_text_config(), "vocab_size", 32000) or 32000)
    return (torch.randint(0, vocab, (1, 16), generator=g, dtype=torch.int64),)
