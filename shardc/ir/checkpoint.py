"""The weight format a plan is priced in, from the checkpoint's ``quantization_config``.

The frontend records what a config.json's ``quantization_config`` says the checkpoint stores
(``Graph.config["checkpoint"] = {"scheme": words, "weights": "fp8" | None}``,
:func:`shardc.frontends.hf_types.checkpoint_format`). An FP8 checkpoint (block-wise or per
tensor) is served in FP8, so it sets the default ``--weights``; an explicit ``--weights``
wins; a scheme shardc does not model (int4, MXFP4, ...) is priced as bf16 with a warning.
plan.json ``model.checkpoint`` records ``{scheme, weights, chosen_by}``.
"""

from __future__ import annotations

import dataclasses

from shardc.ir.strategy import Workload


def checkpoint_weights(config: dict, workload: Workload,
                       from_checkpoint: bool) -> tuple[Workload, dict]:
    """(workload to price, plan.json ``model.checkpoint`` record; ``{}`` without a
    quantization_config). ``from_checkpoint``: the user gave no ``--weights``."""
    ck = config.get("checkpoint") or {}
    if not ck:
        return workload, {}
    record = {"scheme": str(ck.get("scheme")), "weights": ck.get("weights")}
    if not from_checkpoint:
        return workload, {**record, "chosen_by": "--weights"}
    if record["weights"]:
        return dataclasses.replace(workload, weights=record["weights"]), \
            {**record, "chosen_by": "checkpoint"}
    return dataclasses.replace(workload, weights="bf16"), {**record, "chosen_by": "not modelled"}


def checkpoint_line(record: dict, weights: str) -> str:
    """One line saying which weight format prices the plan and why (empty without a
    quantization_config)."""
    if not record:
        return ""
    scheme = record["scheme"]
    if record["chosen_by"] == "checkpoint":
        return f"weights {weights}: the checkpoint's quantization_config ({scheme})"
    if record["chosen_by"] == "--weights":
        return f"weights {weights}: --weights (the checkpoint stores {scheme})"
    return (f"warning: the checkpoint's quantization_config ({scheme}) is not modelled; "
            f"weights priced as {weights}")
