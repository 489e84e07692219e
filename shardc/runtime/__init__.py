"""shardc's torch-only runtime: the ParallelStyles torch lacks and the driver the emitted
``parallelize.py`` calls. Imports torch and the standard library only (no transformers,
no shardc compiler modules), so serving needs nothing else; ``shardc compile
--standalone`` inlines :data:`SOURCES` into the emitted file. torch's own styles and
placements are re-exported, so an emitted file takes its whole vocabulary from here."""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from shardc.runtime.apply import (
    apply_plan,
    decoder_layers,
    install_batch_split,
    make_mesh,
    submesh,
)
from shardc.runtime.bench import bench_main
from shardc.runtime.experts import ExpertParallel
from shardc.runtime.fast import FastModel
from shardc.runtime.gathered_experts import GatheredExperts
from shardc.runtime.generate import fast_generate
from shardc.runtime.head_slices import HeadSlices
from shardc.runtime.kv_cache import KVCache
from shardc.runtime.mamba2_local import Mamba2HeadsParallel
from shardc.runtime.pipeline import keep_stage, pipeline
from shardc.runtime.router import RouterParallel
from shardc.runtime.styles import (
    BatchSplitAttention,
    CoreRowsAttention,
    FullWidthNormParallel,
    GroupedKVAttention,
    HeadParallelAttention,
    PrepareHiddenStates,
    ReplicateParallel,
    WeightColwiseParallel,
    WeightRowwiseParallel,
)

# inlined in this order by ``--standalone`` (the fast runtime after the styles it runs on)
SOURCES = ("styles.py", "head_slices.py", "router.py", "experts.py", "apply.py", "kv_cache.py",
           "local_ops.py", "gpt_moe_local.py", "dbrx_local.py", "moe_local.py", "mla_local.py",
           "mamba2_local.py", "gathered_experts.py",
           "fast.py", "generate.py",
           "bench.py")
PIPELINE_SOURCES = ("pipeline.py",)  # inlined too when the plan has pipeline stages

__all__ = ["BatchSplitAttention", "ColwiseParallel", "CoreRowsAttention",
           "ExpertParallel", "FastModel", "FullWidthNormParallel", "GatheredExperts",
           "GroupedKVAttention", "HeadParallelAttention", "HeadSlices", "KVCache",
           "Mamba2HeadsParallel", "PIPELINE_SOURCES",
           "PrepareHiddenStates", "PrepareModuleInput", "Replicate",
           "ReplicateParallel", "RouterParallel", "RowwiseParallel", "SOURCES", "Shard",
           "WeightColwiseParallel", "WeightRowwiseParallel", "apply_plan", "bench_main",
           "decoder_layers", "fast_generate", "install_batch_split", "keep_stage",
           "make_mesh", "parallelize_module", "pipeline", "submesh"]
