"""shardc.frontends: model descriptions -> IR :class:`~shardc.ir.graph.Graph`.

:func:`load_graph` is what ``compile`` / ``inspect`` / ``simulate`` call: it dispatches on
the file suffix (``.py`` model file or HF ``config.json`` -> torch.export frontend; ``.onnx``
-> :func:`shardc.frontends.onnx_frontend.trace_onnx`, imported lazily) and runs the passes
(canonicalise -> fused-op grouping -> layer grouping). A model file whose ``build_model``
takes ``num_layers`` is traced at a reduced depth and expanded to the exact full-depth graph
(:mod:`shardc.frontends.reduced_depth`). :func:`graph_from_module` does the
same for an in-memory ``nn.Module``. Libraries' stderr output and logging while building and
tracing are swallowed unless ``SHARDC_DEBUG=1`` (:mod:`shardc.frontends.quiet`).
Graphs of model files (``.py``, ``config.json``) are
cached on disk (:mod:`shardc.frontends.graph_cache`; ``SHARDC_NO_CACHE=1`` disables it).
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardc.errors import InputError
from shardc.ir.graph import Graph


def graph_from_module(model, example_inputs: tuple, name: str = "", source: str = "") -> Graph:
    """Trace an ``nn.Module`` (torch.export) and run the passes."""
    from shardc.frontends.quiet import library_output_captured
    from shardc.frontends.stateful_layers import (
        check_traced_recurrent_layers,
        refuse_stateful_layers,
    )
    from shardc.frontends.torch_export import trace_module
    from shardc.passes import run_passes

    where = source or name or type(model).__name__
    refuse_stateful_layers(model, where)
    with library_output_captured():
        traced = trace_module(model, tuple(example_inputs), name=name, source=source)
    graph = run_passes(traced)
    check_traced_recurrent_layers(model, graph, where)
    return graph


def load_graph(path: str | Path, tiny: bool = False) -> Graph:
    """Load ``path`` (``.py`` model file, ``config.json``, ``.onnx``) into a passed IR Graph.

    ``tiny`` traces the file's ``tiny_model()`` instead of the full-size ``build_model()``.
    A model file's graph is served from the on-disk cache when its key (file contents,
    ``tiny``, shardc / torch / transformers versions, frontend and passes code) matches a
    stored entry and the source files the model imported when it was traced are unchanged.
    Raises :class:`InputError` (one line) for a missing or malformed model."""
    p = Path(path)
    if p.suffix == ".onnx":
        if not p.exists():
            raise InputError(f"{path}: no such file")
        from shardc.frontends.onnx_frontend import trace_onnx
        from shardc.passes import run_passes

        return run_passes(trace_onnx(str(p)))
    from shardc.frontends import graph_cache

    key = None
    if graph_cache.cache_enabled() and p.is_file() and p.suffix in (".py", ".json"):
        key = graph_cache.cache_key(p, tiny)
        cached = graph_cache.load_entry(key)
        if cached is not None:
            cached.source = str(p)  # the same file reached by another path string
            _print_notes(cached)
            return cached
    from shardc.frontends.imports import recording_imports
    from shardc.frontends.model_file import load_model_file  # imports torch: after the cache
    from shardc.frontends.quiet import library_output_captured

    with recording_imports() as imported:
        with library_output_captured():  # HF config checks and model building log warnings
            src = load_model_file(p)
            model, inputs = src.build(tiny=tiny)
        from shardc.frontends.stateful_layers import refuse_stateful_layers

        refuse_stateful_layers(model, src.source)  # before a trace would price them wrongly
        graph = None if tiny else _reduced_depth_graph(src, model, inputs)
        if graph is None:
            graph = graph_from_module(model, inputs, name=src.name, source=src.source)
        else:
            from shardc.frontends.stateful_layers import check_traced_recurrent_layers

            check_traced_recurrent_layers(model, graph, src.source)
    from shardc.frontends.fused_experts import fused_experts_note

    notes = list(src.notes) + [n for n in (fused_experts_note(model),) if n]
    if notes:
        graph.config["frontend_notes"] = notes
    if src.checkpoint:
        graph.config["checkpoint"] = dict(src.checkpoint)
    _print_notes(graph)
    if key is not None:
        graph_cache.store_entry(key, graph, deps=imported)
    return graph


def _print_notes(graph: Graph) -> None:
    """The frontend's notes on how it read the model (e.g. a remote-code model type built
    from the transformers class its config names), one ``shardc: note:`` line each, cold or
    cached."""
    for note in graph.config.get("frontend_notes") or ():
        sys.stderr.write(f"shardc: note: {graph.source}: {note}\n")


def _reduced_depth_graph(src, model, inputs) -> Graph | None:
    """The passed graph from a reduced-depth trace (:mod:`shardc.frontends.reduced_depth`) if
    ``src.build_model`` takes ``num_layers`` and ``SHARDC_FULL_TRACE`` is unset; None (trace
    all layers) otherwise, or when the pattern cannot be proven (a note on stderr says so)."""
    from shardc.frontends import reduced_depth

    if not (reduced_depth.enabled() and reduced_depth.accepts_num_layers(src.build_model)):
        return None
    from shardc.frontends.quiet import library_output_captured

    try:
        with library_output_captured():
            raw = reduced_depth.trace_reduced(src, model, inputs)
    except reduced_depth.NotProvable as e:
        sys.stderr.write(f"shardc: note: {src.source}: tracing every layer (a reduced-depth "
                         f"trace cannot be proven exact: {e})\n")
        return None
    if raw is None:
        return None
    from shardc.passes import run_passes

    return run_passes(raw)


__all__ = ["graph_from_module", "load_graph"]
