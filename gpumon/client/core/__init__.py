"""The step core and its sender: what every monitored step runs through.

The step and phase timers (``step_core``, or the C extension ``_hook``), the CUDA-event clock, the
extension point watchers add their fields through, the sender thread with its transport, the
rank's identity and the stall watch. Imports only ``gpumon.wire``; nothing here knows a watcher,
an integration or a framework.
"""
