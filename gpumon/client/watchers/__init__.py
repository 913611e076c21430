"""The watchers ``StepMonitor.watch`` attaches to a model: DDP, FSDP and DeepSpeed (their
communication measured by the ``client.comm`` room), the rank's parallel layout, the memory
breakdown, the CPU wait.

Each adds its fields to a step through the monitor's extension point (``core/extensions.py``)
and never imports the monitor: it is handed one.
"""
