"""`gpumon doctor`: what this node supports, checked for real, as a table or JSON."""

from __future__ import annotations

import errno
import glob
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

# Metric groups probed on each GPU, with the words shown to the user.
GPU_GROUPS = (
    ("utilization", "utilisation"),
    ("memory", "memory"),
    ("power", "power"),
    ("temperature", "temperature"),
    ("clock_events", "clock events"),
    ("nvlink", "NVLink"),
    ("pcie_counters", "PCIe counters"),
    ("gpm", "GPM (SM/tensor/DRAM)"),
    ("ecc", "ECC"),
    ("processes", "process list"),
)


def diagnose(port: int, socket_path: Path) -> dict[str, Any]:
    """Probe NVML, every GPU's metric groups, device permissions, socket directory and port."""
    from gpumon.collectors.nvml import NvmlSource, NvmlUnavailable

    errors: list[str] = []
    report: dict[str, Any] = {"nvml": {}, "gpus": [], "checks": []}
    try:
        source = NvmlSource(lambda collector, error: errors.append(error))
    except NvmlUnavailable as exc:
        report["nvml"] = {"ok": False, "message": str(exc)}
    else:
        try:
            report["nvml"] = {"ok": True, "driver_version": source.driver_version,
                              "nvml_version": source.nvml_version, "gpus": len(source.devices)}
            # Two polls: GPM and counter rates need a pair of samples.
            first = time.monotonic()
            source.sample(time.time(), first)
            time.sleep(0.15)
            samples = source.sample(time.time(), time.monotonic())
            answered = {s.index for s in samples if s.up}  # a slow GPU is not answering
            for device in source.devices:
                static = device.static
                up = device.index in answered
                groups = {label: (up and device.supports(group)) for group, label in GPU_GROUPS}
                report["gpus"].append({
                    "index": static.index, "name": static.name, "uuid": static.uuid,
                    "pci_bus_id": static.pci_bus_id, "up": up,
                    "mig": static.mig_enabled, "nvlink_links": static.nvlink_link_count,
                    "groups": groups,
                })
            report["nvml"]["xid_events"] = source.watch_xids(lambda gpu, xid: None)
        finally:
            source.close()
    report["checks"] = [_device_files(), _socket_dir(socket_path), _port(port)]
    if errors:
        report["nvml"]["errors"] = sorted(set(errors))
    return report


def _device_files() -> dict[str, Any]:
    files = sorted(glob.glob("/dev/nvidia*"))
    if not files:
        return {"check": "device files", "ok": False, "detail": "no /dev/nvidia* device files"}
    unreadable = [f for f in files if not os.access(f, os.R_OK | os.W_OK)]
    if unreadable:
        return {"check": "device files", "ok": False,
                "detail": f"no read/write access to {', '.join(unreadable)}"}
    return {"check": "device files", "ok": True, "detail": f"{len(files)} accessible"}


def _socket_dir(path: Path) -> dict[str, Any]:
    directory = path.parent
    if not directory.exists():
        return {"check": "socket directory", "ok": False,
                "detail": f"{directory} does not exist (the agent creates it if it may)"}
    if not os.access(directory, os.W_OK | os.X_OK):
        return {"check": "socket directory", "ok": False, "detail": f"{directory} is not writable"}
    return {"check": "socket directory", "ok": True, "detail": f"{directory} is writable"}


def _port(port: int) -> dict[str, Any]:
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.bind(("0.0.0.0", port))
    except OSError as exc:
        detail = "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        return {"check": f"port {port}", "ok": False, "detail": detail}
    finally:
        probe.close()
    return {"check": f"port {port}", "ok": True, "detail": "free"}


def run_doctor(port: int, socket_path: Path, json_output: bool) -> None:
    """Diagnose this node and print the report, as tables or as indented JSON."""
    report = diagnose(port=port, socket_path=socket_path)
    if json_output:
        print(json.dumps(report, indent=2))
    else:
        render(report)


def render(report: dict[str, Any]) -> None:
    """Print the report as terminal tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    nvml = report["nvml"]
    if nvml.get("ok"):
        console.print(f"NVML {nvml['nvml_version']}, driver {nvml['driver_version']}, "
                      f"{nvml['gpus']} GPU(s), XID events: "
                      f"{'yes' if nvml.get('xid_events') else 'no'}")
    else:
        console.print(f"[red]NVML unavailable[/red]: {nvml.get('message')}")
    if report["gpus"]:
        table = Table(title="GPUs")
        table.add_column("gpu")
        table.add_column("model")
        for _, label in GPU_GROUPS:
            table.add_column(label)
        for gpu in report["gpus"]:
            marks = ["yes" if ok else "no" for ok in gpu["groups"].values()]
            table.add_row(str(gpu["index"]), gpu["name"] + ("" if gpu["up"] else " (LOST)"), *marks)
        console.print(table)
    checks = Table(title="Node")
    checks.add_column("check")
    checks.add_column("ok")
    checks.add_column("detail")
    for check in report["checks"]:
        checks.add_row(check["check"], "yes" if check["ok"] else "NO", check["detail"])
    console.print(checks)
