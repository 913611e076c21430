"""Pure analysis of gpumon (docs/architecture.md §2, layer 4): no I/O, no clocks; time comes in as arguments.

What a step says:
- ``window``: a step's time window joined with GPU samples; widening short windows.
- ``comm``: a step's collective communication as the verdicts read it (wait, overlap, bus bandwidth).
- ``device_timing``: phase shares of windows whose rank times its phases on the GPU on some steps.
- ``devices``: peak FLOP/s, HBM and NVLink bandwidth by NVML device name; MFU.

Verdicts:
- ``thresholds`` / ``rules`` / ``bottleneck``: which wall a step hits (the rule table) and its flags.
- ``hints``: the mitigation texts a verdict carries.
- ``straggler``: the slow rank of a run, from comparing its ranks' own work, and its cause.
- ``stream``: the streaming engine that turns steps and GPU samples into per-rank analyses;
  ``tracker``: each rank's state in it (what it received, its window history, its analysis).
- ``stall``: where each rank of a stopped run is, and who waits on whom.
- ``goodput``: where each rank's time went (goodput, badput by cause, unsaved work, restarts).

Memory:
- ``oom``: live out-of-memory risk from per-step peaks.
- ``memory``: the memory model shared by the estimator and the live breakdown.
- ``estimate``: the ``gpumon estimate`` memory estimator.

Imports only the standard library, ``gpumon.wire`` (and ``gpumon.wire.frozen``, which makes a
merged window's records without their frozen ``__init__``), ``gpumon.collectors.samples`` and
``gpumon.collectors.gpu_fields`` (the GPU fields a window averages).
"""
