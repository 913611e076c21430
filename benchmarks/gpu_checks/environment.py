"""The environment section: Python, packages, which hook core was built, ``nvidia-smi -q``
(kept whole in nvidia-smi.txt), topology, NVLink, and torch with its device."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys
from typing import Any

from .report import Report, run_cmd


def section_environment(report: Report, result: dict[str, Any]) -> Any:
    """Record the node; returns the torch module (imported here, so a broken torch shows)."""
    result["python"] = sys.version.split()[0]
    result["platform"] = platform.platform()
    result["cpus"] = os.cpu_count()
    result["pid"] = os.getpid()
    versions = {}
    for dist in ("nvidia-ml-py", "pynvml", "torch", "prometheus-client", "psutil", "typer",
                 "rich", "PyYAML", "bcrypt", "tensorboard"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    result["packages"] = versions
    try:
        from gpumon.client.monitor import IMPLEMENTATION
        result["hook_core"] = IMPLEMENTATION  # "c" where setup.py built gpumon.client.core._hook
    except Exception as exc:  # recorded, and the other sections still run
        result["hook_core"] = f"import failed: {exc!r}"
    if versions.get("pynvml"):
        report.finding(f"the deprecated 'pynvml' distribution {versions['pynvml']} is installed "
                       "beside nvidia-ml-py: it may shadow NVIDIA's binding")
    smi = shutil.which("nvidia-smi")
    if smi:
        q = run_cmd([smi, "-q"], 30)
        (report.out / "nvidia-smi.txt").write_text(q["stdout"] + q["stderr"])
        wanted = ("Driver Version", "CUDA Version", "Product Name", "Product Architecture",
                  "Persistence Mode", "Compute Mode", "Total", "Current", "Power Limit",
                  "Bus Id", "Virtualization Mode", "Addressing Mode")
        excerpt: dict[str, str] = {}
        for line in q["stdout"].splitlines():
            if ":" not in line:
                continue
            key, _, value = line.partition(":")
            key = key.strip()
            if key in wanted and key not in excerpt:
                excerpt[key] = value.strip()
        result["nvidia_smi"] = {"rc": q["rc"], "excerpt": excerpt, "seconds": q["seconds"]}
        topo = run_cmd([smi, "topo", "-m"], 20)
        result["nvidia_smi_topo"] = (topo["stdout"] or topo["stderr"])[:3000]
        nvl = run_cmd([smi, "nvlink", "-s"], 20)
        result["nvidia_smi_nvlink"] = (nvl["stdout"] or nvl["stderr"])[:3000]
    else:
        result["nvidia_smi"] = "not found on PATH"
    import torch

    result["torch"] = {"version": torch.__version__, "cuda_build": torch.version.cuda,
                       "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        result["torch"].update({
            "device_count": torch.cuda.device_count(), "name": props.name,
            "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
            "total_memory": total, "free_memory": free,
            "uuid": str(getattr(props, "uuid", "")),
            "bf16": torch.cuda.is_bf16_supported(),
            "cudnn": torch.backends.cudnn.version(),
        })
    return torch

