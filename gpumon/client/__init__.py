"""The training-loop hook: ``StepMonitor`` times steps and phases and reports them to the agent.

Imports only ``gpumon.wire`` and the standard library; torch, Lightning and transformers
are used only by the optional integration modules (``gpumon.client.integrations.lightning``,
``gpumon.client.integrations.hf``) and, when the training code already imported torch, for CUDA timing.
"""

from gpumon.client.monitor import ClientStats, StepMonitor

__all__ = ["ClientStats", "StepMonitor"]
