"""The NVML section: which library the node's processes load (the real one, or the project's
fake with an H200-like scenario for a dry run), and the checks on what the probe child found:
essential fields populated, no collector errors, GPM on Hopper, and gpumon's view agreeing with
the raw calls (a raw success that gpumon left absent is a bug)."""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

from gpumon.testing.fakenvml import build_fake_nvml

from .report import ROOT, Report, run_cmd

ENTRY_POINT = Path(__file__).resolve().parent.parent / "gpu_node_check.py"

FAKE_SCENARIO = """\
# H200-like single GPU for the dry run (written by benchmarks/gpu_checks/nvml.py)
driver_version 580.65.06
nvml_version 13.580.65.06
cuda_driver_version 13000
gpu 0 name NVIDIA H200
gpu 0 memory_total 150754820096
gpu 0 memory_used 1073741824
gpu 0 util_gpu 87
gpu 0 util_memory 41
gpu 0 power_mw 512000
gpu 0 temperature_c 44
gpu 0 nvlink_links 18
gpu 0 nvlink_tx_kib_per_s 1000
gpu 0 nvlink_rx_kib_per_s 1000
gpu 0 pcie_tx_bytes_per_s 1000000
gpu 0 pcie_rx_bytes_per_s 2000000
gpu 0 gpm_sm_util 80
gpu 0 gpm_sm_occupancy 40
gpu 0 gpm_tensor_util 55
gpu 0 gpm_dram_bw_util 30
gpu 0 process {pid} 2147483648
"""



def nvml_environment(mode: str, scratch: Path, report: Report) -> dict[str, str]:
    """The environment for child processes that use NVML (agent, probe): ``real``, ``fake``
    (built here, with FAKE_SCENARIO), or ``auto`` (real when libnvidia-ml.so.1 loads)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMON_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if mode == "auto":
        try:
            ctypes.CDLL("libnvidia-ml.so.1")
            mode = "real"
        except OSError:
            mode = "fake"
    report.data["nvml_mode"] = mode
    if mode == "real":
        env.pop("FAKE_NVML_SCENARIO", None)
        return env
    lib = build_fake_nvml(scratch / "fakenvml")
    scenario = scratch / "h200_dry_run.scn"
    scenario.write_text(FAKE_SCENARIO.format(pid=os.getpid()))
    env["LD_LIBRARY_PATH"] = str(lib.parent)
    env["FAKE_NVML_SCENARIO"] = str(scenario)
    print(f"  NVML: the FAKE library {lib} (dry run), scenario {scenario}", flush=True)
    return env


def section_nvml(report: Report, result: dict[str, Any], env: dict[str, str],
                 scratch: Path) -> dict[str, Any] | None:
    limit = min(75.0, max(20.0, report.remaining() - 150.0))  # a normal run takes ~10 s
    argv = [sys.executable, str(ENTRY_POINT), "--nvml-child",
            "--cycles", "200", "--child-limit", str(limit * 0.6), "--out", str(scratch)]
    proc = run_cmd(argv, limit, env)
    result["child_rc"] = proc["rc"]
    result["child_seconds"] = proc["seconds"]
    if proc.get("timeout"):
        result["child_timeout"] = True
    result["child_stderr_tail"] = proc["stderr"][-4000:]
    lines = [ln for ln in proc["stdout"].splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"the NVML child printed no JSON (rc {proc['rc']}); "
                           f"stderr: {proc['stderr'][-1500:]}")
    data = json.loads(lines[-1])
    result["probe"] = data
    # Checks --------------------------------------------------------------------------------
    report.check("nvml.no_exceptions", not data.get("exceptions"),
                 [e["where"] for e in data.get("exceptions", [])])
    report.check("nvml.no_collector_errors", not data.get("collector_errors"),
                 data.get("collector_errors"))
    for gpu in data.get("gpumon_samples", []):
        report.check(f"nvml.gpu{gpu['index']}.populated", None, sorted(gpu["populated"]))
        report.check(f"nvml.gpu{gpu['index']}.absent", None, gpu["absent"])
        report.check(f"nvml.gpu{gpu['index']}.unsupported_groups", None, gpu["unsupported_groups"])
        # Every read the GPU supports is one prepared call once the plan has settled; one
        # left to the general path fails every poll on this driver (and is slower).
        prepared = gpu.get("prepared_reads", {})
        report.check(f"nvml.gpu{gpu['index']}.fast_set_prepared",
                     bool(prepared) and all(prepared.values()), prepared)
        essential = ("utilization_ratio", "memory_used_bytes", "power_watts",
                     "temperature_celsius", "sm_clock_hz")
        report.check(f"nvml.gpu{gpu['index']}.essentials", all(k in gpu["populated"]
                                                                for k in essential),
                     {k: gpu["populated"].get(k) for k in essential})
    xid = data.get("xid_watcher") or {}
    quiet = xid.get("quiet_wait") or {}
    # The XID wait is one prepared call: on a quiet node it returns at its 1 s timeout, and
    # the agent's look at every poll round (no wait) returns at once.
    report.check("nvml.xid_wait_times_out", quiet.get("event") is False
                 and 0.5 <= quiet.get("seconds", 0.0) <= 3.0, quiet)
    check = xid.get("quiet_check") or {}
    report.check("nvml.xid_check_returns_at_once", check.get("event") is False
                 and check.get("seconds", 1.0) <= 0.05, check)
    stream = data.get("stream") or {}
    handed = stream.get("handed", [])
    # Three cycles of the agent's stream: every GPU handed on by a polling thread, each time.
    report.check("nvml.stream_hands_every_gpu_on",
                 bool(handed) and all(name.startswith("gpumon-nvml-") for name, _ in handed)
                 and sorted(i for _, batch in handed for i in batch)
                 == sorted(stream.get("devices", []) * 3), stream)
    inline = data.get("inline_stream") or {}
    # ... and as the agent runs it: on the asking thread, watched, no hand-over when healthy.
    report.check("nvml.inline_round_on_the_clock",
                 inline.get("watchdog") is True and inline.get("hand_overs") == []
                 and bool(inline.get("handed"))
                 and all(name == inline.get("caller") for name, _ in inline["handed"])
                 and sorted(i for _, batch in inline["handed"] for i in batch)
                 == sorted(inline.get("devices", []) * 3), inline)
    statics = data.get("statics") or []
    for s in statics:
        if "H100" in s.get("name", "") or "H200" in s.get("name", "") or \
                s.get("architecture") == "hopper":
            report.check(f"nvml.gpu{s['index']}.gpm_supported_on_hopper", bool(s.get("gpm_supported")),
                         {"gpm_supported": s.get("gpm_supported"), "mig": s.get("mig_enabled")})
    # Compare gpumon's view with the raw calls: a raw success gpumon left absent is a bug.
    gpumon_field_for = {
        "GetUtilizationRates": "utilization_ratio", "GetPowerUsage": "power_watts",
        "GetTemperatureV": "temperature_celsius", "GetClockInfo_SM": "sm_clock_hz",
        "GetMemoryInfo_v2": "memory_used_bytes",
        "GetCurrentClocksEventReasons": "clock_event_reasons",
        "GetComputeRunningProcesses_v3": "process_memory_bytes",
        "GetTotalEccErrors_corrected_volatile": "ecc_errors_total",
    }
    mismatches = []
    samples_by_index = {g["index"]: g for g in data.get("gpumon_samples", [])}
    for raw in data.get("raw", []):
        gpu = samples_by_index.get(raw["index"])
        if gpu is None:
            continue
        for call, field in gpumon_field_for.items():
            ok = raw["calls"].get(call, {}).get("ok")
            if ok and field not in gpu["populated"]:
                mismatches.append(f"gpu{raw['index']}: {call} answers but {field} is absent")
        gpm = raw["calls"].get("GPM", {})
        for name, field in (("SM_UTIL", "sm_active_ratio"), ("ANY_TENSOR_UTIL", "tensor_active_ratio"),
                            ("DRAM_BW_UTIL", "dram_active_ratio"),
                            ("SM_OCCUPANCY", "sm_occupancy_ratio")):
            m = gpm.get("metrics", {}).get(name)
            if m and m.get("return") == 0 and field not in gpu["populated"]:
                mismatches.append(f"gpu{raw['index']}: GPM {name} answers but {field} is absent")
        for entry in raw["calls"].get("GetFieldValues", {}).get("entries", []):
            label = entry["field"]
            if entry.get("return") == 0 and "PCIE_COUNT_TX" in label and \
                    "pcie_tx_bytes_total" not in gpu["populated"]:
                mismatches.append(f"gpu{raw['index']}: field {label} answers but "
                                  "pcie_tx_bytes_total is absent")
            if entry.get("return") == 0 and label.endswith("DATA_TX[all]") and \
                    "nvlink_tx_bytes_total" not in gpu["populated"]:
                mismatches.append(f"gpu{raw['index']}: field {label} answers but "
                                  "nvlink_tx_bytes_total is absent")
    report.check("nvml.gpumon_matches_raw_calls", not mismatches, mismatches)
    cost = data.get("cost") or {}
    report.check("nvml.collection_cost", None, {k: cost.get(k) for k in (
        "gpus", "cycles_each", "gpumon_cpu_s_per_cycle", "gpumon_wall_s_per_cycle",
        "bare_cpu_s_per_cycle", "bare_wall_s_per_cycle", "cpu_ratio_gpumon_to_bare",
        "error_count")})
    return data



def markdown(d: dict[str, Any]) -> list[str]:
    """The raw calls per GPU, field values with their per-entry codes, GPM, child tracebacks."""
    lines: list[str] = []
    probe = d["sections"].get("nvml", {}).get("probe") or {}
    for raw in probe.get("raw", []):
        lines += ["", f"## Raw NVML calls, GPU {raw['index']}", "", "| call | result | µs |",
                  "|---|---|---|"]
        for call, res in raw["calls"].items():
            if call in ("GetFieldValues", "GPM", "GetNvLinkState") or not isinstance(res, dict):
                continue
            value = res.get("value") if res.get("ok") else res.get("error")
            text = json.dumps(value, default=str).replace("|", "\\|")[:160]
            lines.append(f"| {call} | {'ok' if res.get('ok') else 'ERR'} {text} | {res.get('us', '')} |")
        lines.append(f"| GetNvLinkState | {json.dumps(raw['calls'].get('GetNvLinkState'))} | |")
        fv = raw["calls"].get("GetFieldValues", {})
        lines += ["", "Field values (per-entry return codes):", ""]
        for e in fv.get("entries", []):
            lines.append(f"- {e['field']}: return {e['return']} "
                         f"{e.get('value', e.get('error', ''))}")
        gpm = raw["calls"].get("GPM", {})
        lines += ["", f"GPM: supported={gpm.get('isSupportedDevice')} "
                      f"sample_get_us={gpm.get('sample_get_us')} "
                      f"metrics_get_us={gpm.get('metrics_get_us')} {gpm.get('error', '')}", ""]
        for m, v in (gpm.get("metrics") or {}).items():
            lines.append(f"- {m} (id {v['id']}): return {v['return']} value {v['value']}")
    for exc in probe.get("exceptions", []):
        lines += ["", f"## Traceback in the NVML child: {exc['where']}", "", "```",
                  exc["traceback"], "```"]
    return lines
