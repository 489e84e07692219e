"""The serving search (``--phase serve``, SPEC section 11): requests of ``isl`` input and
``osl`` output tokens under TTFT and TPOT SLOs, served by aggregated or disaggregated pools.

* :mod:`shardc.serving.pool_models` -- each pool's workload and :class:`~shardc.cost.CostModel`
  (the engine's scheduler, paged KV, the disaggregated ratio and KV transfer);
* :mod:`shardc.serving.search` -- :func:`~shardc.serving.search.serve_search`: every pool
  searched in its own space, everything reported solved from the recorded rows;
* :mod:`shardc.serving.pools` -- a pool's recorded rows and the agg / disagg solves over them;
* :mod:`shardc.serving.splits` -- the search once per experts split the runtime runs;
* :mod:`shardc.serving.explain` -- why a plan stops where it does (binding constraint, what
  is short).
"""
