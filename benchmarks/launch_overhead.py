"""Compile time with and without the engines' launch searches (plan.json ``launch``): the
same compile (default RL search) run with ``launch=False`` and ``launch=True`` after a warm-up
compile (graph cache and kernel tables loaded). Prints one line per case.

    PYTHONPATH=. python benchmarks/launch_overhead.py
"""

import time

import shardc
from shardc.ir.strategy import Workload

CASES = (("examples/configs/glm4_5_air/config.json", "8x1", Workload(phase="decode")),
         ("examples/mixtral_8x7b.py", "8x128", Workload(phase="decode")),
         ("examples/llama3_70b.py", "8x1", Workload(phase="serve", isl=2048, osl=2048)))

if __name__ == "__main__":
    for model, mesh, wl in CASES:
        shardc.compile(model, mesh=mesh, workload=wl, search="megatron", launch=False)
        out = {}
        for launch in (False, True):
            t0, c0 = time.perf_counter(), time.process_time()
            shardc.compile(model, mesh=mesh, workload=wl, launch=launch)
            out[launch] = (round(time.perf_counter() - t0, 1), round(time.process_time() - c0, 1))
        print(f"{model} {mesh} {wl.phase}: without launch {out[False][0]} s wall "
              f"({out[False][1]} s CPU), with {out[True][0]} s wall ({out[True][1]} s CPU)",
              flush=True)
