"""gradindex: training-data attribution as vector search over compressed per-example gradients."""

__version__ = "0.1.0"
