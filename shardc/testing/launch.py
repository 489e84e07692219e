"""Launch a function on ``world`` local processes and collect what each rank wrote.

The multi-process harness behind ``shardc verify`` and the gloo tests: the processes start
from a fork server that has the heavy imports preloaded (a fresh single-threaded server
process, so forking it is safe; process start-up otherwise dominates a launch), rendezvous
on a free loopback port (127.0.0.1 only), and each rank writes its result as JSON into a
temporary folder the launcher reads back. ``SHARDC_VERIFY_SPAWN=1`` (or a platform without
a fork server) uses ``spawn`` instead.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method(preload: Sequence[str] = ()) -> str:
    """``forkserver`` with ``preload`` imported by the server; ``spawn`` where there is no
    fork server or when ``SHARDC_VERIFY_SPAWN=1``."""
    import multiprocessing

    if os.environ.get("SHARDC_VERIFY_SPAWN", "") not in ("", "0") or \
            "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    return "forkserver"


def launch(worker: Callable, world: int, args: tuple, timeout_s: float = 900,
           preload: Sequence[str] = ()) -> list:
    """Run ``worker(rank, world, port, *args, out_dir)`` on ``world`` processes; each rank
    writes ``rank<r>.json`` into ``out_dir``. Returns the parsed file of every rank ([] for a
    rank that wrote none). Raises TimeoutError after ``timeout_s`` seconds (workers killed)."""
    import torch.multiprocessing as mp

    method = start_method(preload)
    with tempfile.TemporaryDirectory(prefix="shardc-launch-") as tmp:
        ctx = mp.start_processes(worker, args=(world, free_port(), *args, tmp), nprocs=world,
                                 join=False, start_method=method)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.terminate()
                raise TimeoutError(f"workers did not finish in {timeout_s:.0f} s")
        per_rank = []
        for r in range(world):
            p = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(p):
                with open(p) as fh:
                    per_rank.append(json.load(fh))
            else:
                per_rank.append([])
    return per_rank


def run_cases(rank: int, world: int, port: int, out_dir: str, cases: Sequence,
              run_case: Callable[[object], dict]) -> None:
    """The body of a gloo rank that runs ``cases`` one by one: rendezvous on
    ``127.0.0.1:port`` (one thread per rank), ``run_case(case)`` for each -- its dict, or
    ``{"error": <type: message + traceback>}`` when it raised (the other cases still run) --
    then the group is torn down and the list written to ``out_dir/rank<r>.json`` (what
    :func:`launch` reads back)."""
    import traceback

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    try:
        for case in cases:
            try:
                results.append(run_case(case))
            except Exception as e:  # reported per case
                results.append({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
