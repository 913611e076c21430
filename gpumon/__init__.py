"""gpumon: a GPU training monitor for Prometheus."""

__version__ = "0.1.0"
