"""shardc's torch-only runtime: the ParallelStyles torch lacks and the driver the emitted
``parallelize.py`` calls. Imports torch and the standard library only (no transformers,
no shardc compiler modules), so serving needs nothing else; ``shardc compile
--standalone`` inlines :data:`SOURCES` into the emitted file."""

from shardc.runtime.apply import apply_plan, install_batch_split, make_mesh, submesh
from shardc.runtime.styles import BatchSplitAttention, ExpertParallel, ReplicateParallel

SOURCES = ("styles.py", "apply.py")  # inlined in this order by ``--standalone``

__all__ = ["BatchSplitAttention", "ExpertParallel", "ReplicateParallel", "apply_plan",
           "install_batch_split", "make_mesh", "submesh", "SOURCES"]
