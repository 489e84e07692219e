"""shardc.cost -- hardware presets, topology, collectives and the inference cost model.

Public entry points::

    load_hardware(name_or_path) -> Hardware
    CostModel(graph, mesh, hardware, workload).evaluate(actions, space) -> Evaluation
    CostModel.simulate(strategy) / .chrome_trace(strategy) / .branch_tables(degrees, space)
    min_gpus_needed(graph, workload, hardware) -> int
"""

from shardc.cost.capacity import min_gpus_needed
from shardc.cost.hardware_presets import Hardware, load_hardware, preset_names
from shardc.cost.model import REASONS, CostModel, Evaluation, reason_text

__all__ = ["CostModel", "Evaluation", "Hardware", "REASONS", "load_hardware", "min_gpus_needed",
           "preset_names", "reason_text"]
