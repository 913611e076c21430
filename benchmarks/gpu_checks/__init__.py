"""The sections of benchmarks/gpu_node_check.py, the device script: one module per thing it
checks on a GPU node (environment, nvml + nvml_probe, agent, hook, oom, ddp, memory), over the
shared harness in gpumon.testing, writing into one Report (report.py)."""
