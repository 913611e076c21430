"""The watchers ``StepMonitor.watch`` attaches to a model: DDP, FSDP and DeepSpeed, the
collective taps, the memory breakdown, the CPU wait.

Each adds its fields to a step through the monitor's extension point (``core/extensions.py``)
and never imports the monitor: it is handed one.
"""
