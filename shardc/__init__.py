"""shardc: a sharding compiler for distributed LLM inference."""

__version__ = "0.1.0"

from shardc.ir.strategy import Workload  # noqa: E402

__all__ = ["Workload", "__version__"]
