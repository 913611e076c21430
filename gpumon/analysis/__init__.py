"""Pure analysis of gpumon (docs/architecture.md §2, layer 4): no I/O, no clocks; time comes in as arguments.

- ``devices``: peak FLOP/s, HBM and NVLink bandwidth by NVML device name; MFU.
- ``window``: a step's time window joined with GPU samples; widening short windows.
- ``thresholds`` / ``bottleneck``: which wall a step hits, flags, straggler scores.
- ``oom``: live out-of-memory risk from per-step peaks.
- ``estimate``: the ``gpumon estimate`` memory estimator.

Imports only the standard library, ``gpumon.wire`` and ``gpumon.collectors.samples``.
"""
