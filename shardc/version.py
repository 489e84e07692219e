"""shardc's version (one place: the package, generated files and the graph cache key read it)."""

__version__ = "0.1.0"
