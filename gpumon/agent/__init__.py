"""The agent: configuration, collection schedule, analyzer, recorder, the views scrapes read,
and the lifecycle (``gpumon.agent.lifecycle.Agent``) that wires them to the exporter."""
