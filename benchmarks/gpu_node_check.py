"""One-shot check of gpumon on a real GPU node: NVML support, the agent, the CUDA hook, overhead.

    PYTHONPATH=. python3 benchmarks/gpu_node_check.py --out DIR [--budget-s 270] [--nvml auto]

Written to be run once on a GPU node with no network and little time to spare, and to bring
back everything worth knowing from that run, in at most 8 files under ``--out``:

    summary.json               every result, check and traceback (rewritten after each section)
    summary.md                 the same, readable
    nvidia-smi.txt             ``nvidia-smi -q``
    metrics_mid_training.txt   /metrics while the CUDA training loop runs (GPU gauges busy)
    metrics_after_training.txt /metrics once the agent has analysed the steps
    metrics_oom.txt            /metrics at the highest OOM risk of the memory-pressure test
    recording.jsonl.gz         the agent's ``--record`` of every step and GPU sample
    agent.log                  the agent's log

Sections (each one timed and wrapped: a failure is recorded with its traceback and the
next section still runs; a watchdog ends the whole script before ``--budget-s``):

1. environment: nvidia-smi, driver/CUDA, Python packages, torch and its device.
2. nvml: in a child process, gpumon's own NvmlSource on the real library (statics, which
   GpuSample fields are populated, groups found NOT_SUPPORTED, collector errors, the XID
   watcher), every raw NVML call gpumon relies on with its return code and wall time, the
   GPM metrics one by one, ``gpumon doctor``'s report, and the CPU cost of one collection
   cycle against the bare pynvml calls.
3. agent + training: ``python -m gpumon.cli agent`` on a free port with its socket in a
   temp dir, a bf16 transformer trained on the GPU with ``StepMonitor`` (data, forward,
   backward, optimizer), /metrics scraped while it runs and after; checks that the steps
   arrived, verdicts exist, CUDA-event phase times add up to the step time, torch memory
   metrics are there, the rank is attributed to the NVML GPU, the GPU looked busy.
4. overhead: blocks of steps with and without the hook, alternating (median ratio of
   hooked to bare throughput), for the GPU-bound transformer and a launch-bound small MLP.
5. oom: memory held in growing chunks up to ~85 % of the device (never more), with steps
   running, /metrics polled for gpumon_oom_risk_ratio / _predicted_seconds; then freed;
   then a *raised* (not allocated) torch.OutOfMemoryError through the hook's step.
6. replay: ``gpumon classify`` over the recording.

Without CUDA (a dry run on a CPU machine) the NVML child loads the project's fake
libnvidia-ml (tests/fakenvml, built with gcc) with an H200-like scenario, the training runs
a tiny model on the CPU, and the CUDA-only parts are recorded as "skipped: no CUDA".
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gzip
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpumon.testing import free_port, http_get  # noqa: E402

RUN = "gpu-node-check"
OOM_RUN = "gpu-node-check-oom"
MAX_MEMORY_SHARE = 0.85  # never hold more than this share of device memory (NVML's count)
GIB = 2**30

FAKE_SCENARIO = """\
# H200-like single GPU for the dry run (written by benchmarks/gpu_node_check.py)
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


# ----------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------

def now() -> float:
    return time.monotonic()


def tb() -> str:
    return traceback.format_exc(limit=12)


def jsonable(value: Any, depth: int = 0) -> Any:
    """Plain JSON data from NVML structs, dataclasses, bytes, ... (bounded)."""
    if depth > 16:
        return repr(value)[:200]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in list(value.items())[:64]}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v, depth + 1) for v in list(value)[:64]]
    if hasattr(value, "_fields_"):  # ctypes struct
        return {name: jsonable(getattr(value, name, None), depth + 1)
                for name, *_ in value._fields_ if not name.startswith("_")}
    if isinstance(value, ctypes.Array):
        return [jsonable(v, depth + 1) for v in list(value)[:16]]
    if hasattr(value, "__dataclass_fields__"):
        return {k: jsonable(getattr(value, k), depth + 1) for k in value.__dataclass_fields__}
    if hasattr(value, "__dict__"):
        return {k: jsonable(v, depth + 1) for k, v in vars(value).items() if not k.startswith("_")}
    return repr(value)[:200]


def get_text(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body as text) of a GET; HTTP errors are returned, not raised."""
    code, body = http_get(url, timeout)
    return code, body.decode(errors="replace")


Samples = list[tuple[str, dict[str, str], float]]


def parse_metrics(text: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.append((sample.name, dict(sample.labels), float(sample.value)))
    return out


def select(samples: Samples, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    return [(lab, v) for n, lab, v in samples
            if n == name and all(lab.get(k) == want for k, want in labels.items())]


def first(samples: Samples, name: str, **labels: str) -> float | None:
    found = select(samples, name, **labels)
    return found[0][1] if found else None


def gib(value: float | None) -> float | None:
    return None if value is None else round(value / GIB, 2)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_cmd(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a command with a timeout; never raises."""
    start = now()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT, stdin=subprocess.DEVNULL)
        return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                "seconds": round(now() - start, 3)}
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        return {"rc": None, "timeout": True, "stdout": out or "", "stderr": err or "",
                "seconds": round(now() - start, 3)}
    except OSError as exc:
        return {"rc": None, "error": f"{type(exc).__name__}: {exc}", "stdout": "", "stderr": "",
                "seconds": round(now() - start, 3)}


# ----------------------------------------------------------------------------------------
# The report: summary.json rewritten after every section, summary.md at the end
# ----------------------------------------------------------------------------------------

class Report:
    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.t0 = now()
        self.deadline = self.t0 + budget_s
        self.data: dict[str, Any] = {
            "script": "benchmarks/gpu_node_check.py",
            "started_unix": time.time(),
            "budget_s": budget_s,
            "sections": {},
            "checks": {},
            "findings": [],
        }
        self.lock = threading.RLock()
        self.children: list[subprocess.Popen[bytes]] = []

    def remaining(self) -> float:
        return self.deadline - now()

    def check(self, name: str, ok: bool | None, detail: Any = None) -> None:
        """ok: True passed, False failed, None informational."""
        with self.lock:
            self.data["checks"][name] = {"ok": ok, "detail": jsonable(detail)}
        mark = {True: "PASS", False: "FAIL", None: "info"}[ok]
        text = json.dumps(jsonable(detail), default=str)
        print(f"  [{mark}] {name}: {text[:300]}", flush=True)

    def finding(self, text: str) -> None:
        with self.lock:
            self.data["findings"].append(text)
        print(f"  finding: {text}", flush=True)

    def run(self, name: str, fn: Callable[[dict[str, Any]], Any], need_s: float = 0.0) -> Any:
        """Run one section: timed, its failure recorded (with traceback) and not raised."""
        result: dict[str, Any] = {}
        with self.lock:
            self.data["sections"][name] = result
        left = self.remaining()
        print(f"== {name} ({left:.0f} s of budget left)", flush=True)
        if left < need_s:
            result["status"] = f"skipped: {left:.0f} s left, needs {need_s:.0f} s"
            print(f"  {result['status']}", flush=True)
            self.write()
            return None
        start = now()
        value = None
        try:
            value = fn(result)
        except SkipSection as exc:
            result["status"] = f"skipped: {exc}"
            print(f"  {result['status']}", flush=True)
        except Exception as exc:
            result["status"] = "error"
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["traceback"] = tb()
            print(f"  ERROR {result['error']}\n{result['traceback']}", flush=True)
        else:
            result.setdefault("status", "ok")
        finally:
            result["seconds"] = round(now() - start, 2)
            self.write()
        return value

    def write(self) -> None:
        with self.lock:
            self.data["elapsed_s"] = round(now() - self.t0, 2)
            tmp = self.out / ".summary.json.tmp"
            tmp.write_text(json.dumps(jsonable(self.data), indent=1, default=str))
            os.replace(tmp, self.out / "summary.json")

    def start_watchdog(self) -> None:
        def watch() -> None:
            while self.remaining() > 0:
                time.sleep(0.5)
            stacks = {str(tid): "".join(traceback.format_stack(frame, limit=15))
                      for tid, frame in sys._current_frames().items()}
            with self.lock:
                self.data["watchdog"] = {"fired_at_s": round(now() - self.t0, 1), "stacks": stacks}
            print("WATCHDOG: budget exhausted, writing what there is and exiting", flush=True)
            for child in self.children:
                with contextlib.suppress(Exception):
                    os.killpg(child.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.write()
                write_markdown(self)
            os._exit(3)

        threading.Thread(target=watch, name="watchdog", daemon=True).start()


class SkipSection(Exception):
    pass


# ----------------------------------------------------------------------------------------
# The NVML child: runs in its own process (the real library, or the fake via env)
# ----------------------------------------------------------------------------------------

def nvml_child(cycles: int, time_limit_s: float, scratch: str) -> dict[str, Any]:
    deadline = now() + time_limit_s
    out: dict[str, Any] = {"exceptions": []}

    def failed(where: str) -> None:
        out["exceptions"].append({"where": where, "traceback": tb()})

    import pynvml

    from gpumon.collectors import nvml as gnvml
    from gpumon.collectors.samples import GpuSample

    errors: list[list[str]] = []
    on_error = lambda collector, error: errors.append([collector, error])  # noqa: E731

    # 1. gpumon's own source ------------------------------------------------------------
    source = None
    try:
        source = gnvml.NvmlSource(on_error)
        out["driver_version"] = source.driver_version
        out["nvml_version"] = source.nvml_version
        out["statics"] = [jsonable(s) for s in source.statics()]
    except Exception:
        failed("NvmlSource()")
    with contextlib.suppress(OSError):
        maps = Path("/proc/self/maps").read_text()
        out["library_loaded"] = sorted({line.split()[-1] for line in maps.splitlines()
                                        if "libnvidia-ml" in line})
    if source is not None:
        samples: list[Any] = []
        try:
            for _ in range(5):  # GPM needs a pair >= 100 ms apart, counter rates need two
                samples.extend(source.sample(time.time(), now()))
                time.sleep(0.3)
        except Exception:
            failed("NvmlSource.sample()")
        fields = [f for f in GpuSample.__dataclass_fields__ if f not in ("index", "t")]
        per_gpu = []
        for device in source.devices:
            mine = [s for s in samples if s.index == device.index]
            last = mine[-1] if mine else None
            populated = {f: jsonable(getattr(last, f)) for f in fields
                         if last is not None and getattr(last, f) is not None}
            per_gpu.append({
                "index": device.index,
                "populated": populated,
                "absent": [f for f in fields if f not in populated],
                "unsupported_groups": sorted(getattr(device, "_unsupported", set())),
                "samples_taken": len(mine),
            })
        out["gpumon_samples"] = per_gpu
        # XID watcher: registers, waits (no event expected), stops.
        try:
            xids: list[tuple[int, int]] = []
            watcher = source.xid_watcher(lambda gpu, xid: xids.append((gpu, xid)))
            watcher.start()
            time.sleep(2.5)
            watcher.stop()
            watcher.join(timeout=3.0)
            out["xid_watcher"] = {"registered": watcher.registered, "events": xids,
                                  "still_alive": watcher.is_alive()}
            watcher.close()
        except Exception:
            failed("XidWatcher")
    out["collector_errors"] = list(errors)

    # 2. raw NVML, call by call -------------------------------------------------------------
    def call(name: str, *args: Any) -> dict[str, Any]:
        fn = getattr(pynvml, name, None)
        if fn is None:
            return {"ok": False, "error": "not in this nvidia-ml-py"}
        start = time.perf_counter()
        try:
            value = fn(*args)
            res: dict[str, Any] = {"ok": True, "value": jsonable(value)}
        except pynvml.NVMLError as exc:
            res = {"ok": False, "error": type(exc).__name__, "code": exc.value}
        except Exception as exc:
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        res["us"] = round((time.perf_counter() - start) * 1e6, 1)
        return res

    raw: list[dict[str, Any]] = []
    try:
        if source is None:
            pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        out["device_count"] = count
        out["raw_system"] = {
            "driver": call("nvmlSystemGetDriverVersion"),
            "nvml": call("nvmlSystemGetNVMLVersion"),
            "cuda_driver": call("nvmlSystemGetCudaDriverVersion_v2"),
        }
        for index in range(min(count, 8)):
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            calls: dict[str, Any] = {}
            p = pynvml
            calls["GetName"] = call("nvmlDeviceGetName", h)
            calls["GetUUID"] = call("nvmlDeviceGetUUID", h)
            calls["GetPciInfo"] = call("nvmlDeviceGetPciInfo", h)
            calls["GetArchitecture"] = call("nvmlDeviceGetArchitecture", h)
            calls["GetMigMode"] = call("nvmlDeviceGetMigMode", h)
            calls["GetMemoryInfo_v2"] = call("nvmlDeviceGetMemoryInfo", h, p.nvmlMemory_v2)
            calls["GetMemoryInfo_v1"] = call("nvmlDeviceGetMemoryInfo", h)
            calls["GetUtilizationRates"] = call("nvmlDeviceGetUtilizationRates", h)
            calls["GetPowerUsage"] = call("nvmlDeviceGetPowerUsage", h)
            calls["GetPowerManagementLimit"] = call("nvmlDeviceGetPowerManagementLimit", h)
            calls["GetTotalEnergyConsumption"] = call("nvmlDeviceGetTotalEnergyConsumption", h)
            calls["GetTemperatureV"] = call("nvmlDeviceGetTemperatureV", h, p.NVML_TEMPERATURE_GPU)
            calls["GetTemperature"] = call("nvmlDeviceGetTemperature", h, p.NVML_TEMPERATURE_GPU)
            calls["GetClockInfo_SM"] = call("nvmlDeviceGetClockInfo", h, p.NVML_CLOCK_SM)
            calls["GetClockInfo_MEM"] = call("nvmlDeviceGetClockInfo", h, p.NVML_CLOCK_MEM)
            calls["GetMaxClockInfo_SM"] = call("nvmlDeviceGetMaxClockInfo", h, p.NVML_CLOCK_SM)
            calls["GetCurrentClocksEventReasons"] = call("nvmlDeviceGetCurrentClocksEventReasons", h)
            calls["GetCurrentClocksThrottleReasons"] = call(
                "nvmlDeviceGetCurrentClocksThrottleReasons", h)
            calls["GetTotalEccErrors_corrected_volatile"] = call(
                "nvmlDeviceGetTotalEccErrors", h, p.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                p.NVML_VOLATILE_ECC)
            calls["GetComputeRunningProcesses_v3"] = call(
                "nvmlDeviceGetComputeRunningProcesses_v3", h)
            calls["GetPcieThroughput_TX"] = call("nvmlDeviceGetPcieThroughput", h,
                                                 p.NVML_PCIE_UTIL_TX_BYTES)
            calls["GetSupportedEventTypes"] = call("nvmlDeviceGetSupportedEventTypes", h)
            util_samples = call("nvmlDeviceGetSamples", h, p.NVML_GPU_UTILIZATION_SAMPLES, 0)
            if util_samples.get("ok"):  # (value type, samples): keep the count and the last
                value = util_samples["value"]
                if isinstance(value, list) and len(value) == 2 and isinstance(value[1], list):
                    util_samples["value"] = {"count": len(value[1]),
                                             "last": value[1][-1] if value[1] else None}
            calls["GetSamples_GPU_UTIL"] = util_samples
            links = [call("nvmlDeviceGetNvLinkState", h, link) for link in range(18)]
            calls["GetNvLinkState"] = {
                "active": sum(1 for r in links if r.get("ok") and r.get("value") == 1),
                "ok": sum(1 for r in links if r.get("ok")),
                "errors": sorted({str(r.get("error")) for r in links if not r.get("ok")}),
            }
            # Field values: per-entry return codes are the point.
            field_ids: list[Any] = []
            for name in ("NVML_FI_DEV_NVLINK_LINK_COUNT", "NVML_FI_DEV_PCIE_COUNT_TX_BYTES",
                         "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                         "NVML_FI_DEV_PCIE_REPLAY_COUNTER"):
                if hasattr(p, name):
                    field_ids.append((name, getattr(p, name)))
            for name in ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
                         "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
                         "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX"):
                if hasattr(p, name):
                    field_ids.append((f"{name}[all]", (getattr(p, name), gnvml.ALL_LINKS_SCOPE)))
                    field_ids.append((f"{name}[link0]", (getattr(p, name), 0)))
            entries = []
            start = time.perf_counter()
            try:
                values = p.nvmlDeviceGetFieldValues(h, [fid for _, fid in field_ids])
                took = (time.perf_counter() - start) * 1e6
                for (label, _), entry in zip(field_ids, values, strict=False):
                    code = entry.nvmlReturn
                    item: dict[str, Any] = {"field": label, "return": code}
                    if code == p.NVML_SUCCESS:
                        item["value"] = gnvml._field_value(entry)
                        item["valueType"] = entry.valueType
                    else:
                        item["error"] = jsonable(p.nvmlErrorString(code))
                    entries.append(item)
                calls["GetFieldValues"] = {"ok": True, "us": round(took, 1), "entries": entries}
            except Exception as exc:
                calls["GetFieldValues"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            calls["GPM"] = raw_gpm(p, h)
            raw.append({"index": index, "calls": calls})
    except Exception:
        failed("raw NVML probe")
    out["raw"] = raw

    # 3. gpumon doctor ------------------------------------------------------------------------
    try:
        from gpumon.commands.doctor import diagnose

        out["doctor"] = jsonable(diagnose(port=free_port(),
                                          socket_path=Path(scratch) / "doctor.sock"))
    except Exception:
        failed("gpumon.commands.doctor.diagnose")

    # 4. CPU cost of a collection cycle ------------------------------------------------------
    try:
        out["cost"] = collection_cost(pynvml, gnvml, cycles, deadline)
    except Exception:
        failed("collection cost")
    if source is not None:
        with contextlib.suppress(Exception):
            source.close()
    return out


def raw_gpm(p: Any, h: Any) -> dict[str, Any]:
    """GPM support, two samples 200 ms apart, then every metric of interest with its code."""
    res: dict[str, Any] = {}
    try:
        support = p.nvmlGpmQueryDeviceSupport(h)
        res["isSupportedDevice"] = int(support.isSupportedDevice)
    except Exception as exc:
        res["query_error"] = f"{type(exc).__name__}: {exc}"
        return res
    if not res["isSupportedDevice"]:
        return res
    names = ["GRAPHICS_UTIL", "SM_UTIL", "SM_OCCUPANCY", "INTEGER_UTIL", "ANY_TENSOR_UTIL",
             "DFMA_TENSOR_UTIL", "HMMA_TENSOR_UTIL", "IMMA_TENSOR_UTIL", "DRAM_BW_UTIL",
             "FP64_UTIL", "FP32_UTIL", "FP16_UTIL", "PCIE_TX_PER_SEC", "PCIE_RX_PER_SEC",
             "NVLINK_TOTAL_RX_PER_SEC", "NVLINK_TOTAL_TX_PER_SEC"]
    ids = [(n, getattr(p, f"NVML_GPM_METRIC_{n}")) for n in names
           if hasattr(p, f"NVML_GPM_METRIC_{n}")]
    samples = []
    try:
        samples = [p.nvmlGpmSampleAlloc(), p.nvmlGpmSampleAlloc()]
        start = time.perf_counter()
        p.nvmlGpmSampleGet(h, samples[0])
        res["sample_get_us"] = round((time.perf_counter() - start) * 1e6, 1)
        time.sleep(0.2)
        p.nvmlGpmSampleGet(h, samples[1])
        request = p.c_nvmlGpmMetricsGet_t()
        request.version = p.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(ids)
        request.sample1 = samples[0]
        request.sample2 = samples[1]
        for i, (_, metric_id) in enumerate(ids):
            request.metrics[i].metricId = metric_id
        start = time.perf_counter()
        result = p.nvmlGpmMetricsGet(request)
        res["metrics_get_us"] = round((time.perf_counter() - start) * 1e6, 1)
        metrics = {}
        for i, (name, metric_id) in enumerate(ids):
            m = result.metrics[i]
            metrics[name] = {"id": metric_id, "return": m.nvmlReturn,
                             "value": float(m.value) if m.nvmlReturn == p.NVML_SUCCESS else None}
        res["metrics"] = metrics
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = tb()
    finally:
        for s in samples:
            with contextlib.suppress(Exception):
                p.nvmlGpmSampleFree(s)
    return res


def collection_cost(pynvml: Any, gnvml: Any, cycles: int, deadline: float) -> dict[str, Any]:
    """CPU (process_time) and wall per NvmlSource.sample() cycle vs the bare pynvml calls.

    As benchmarks/bench_agent.py: back to back, gpumon's clock advanced one 1 s interval per
    cycle, so a GPM pair is read every cycle and the slow set (processes, ECC) every tenth.
    """
    errors: list[list[str]] = []
    source = gnvml.NvmlSource(lambda c, e: errors.append([c, e]))
    handles = [d._handle for d in source.devices]
    gpus = len(handles)
    fields = [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, gnvml.ALL_LINKS_SCOPE),
              (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, gnvml.ALL_LINKS_SCOPE),
              pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]

    def guarded(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except pynvml.NVMLError:
            pass

    def bare_cycle(_i: int) -> None:
        for h in handles:
            guarded(pynvml.nvmlDeviceGetMemoryInfo, h, pynvml.nvmlMemory_v2)
            guarded(pynvml.nvmlDeviceGetUtilizationRates, h)
            guarded(pynvml.nvmlDeviceGetPowerUsage, h)
            guarded(pynvml.nvmlDeviceGetTemperatureV, h, pynvml.NVML_TEMPERATURE_GPU)
            guarded(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
            guarded(pynvml.nvmlDeviceGetCurrentClocksEventReasons, h)
            guarded(pynvml.nvmlDeviceGetFieldValues, h, fields)

    base = now() + 1000.0

    def gpumon_cycle(i: int) -> None:
        source.sample(time.time(), base + i)

    results: dict[str, dict[str, list[float]]] = {"gpumon": {"cpu": [], "wall": []},
                                                  "bare": {"cpu": [], "wall": []}}
    rounds = 5
    per_round = max(1, cycles // rounds)
    done = 0
    for _ in range(rounds):
        if now() > deadline:
            break
        for name, fn in (("gpumon", gpumon_cycle), ("bare", bare_cycle)):
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for i in range(done, done + per_round):
                fn(i)
            results[name]["cpu"].append((time.process_time() - cpu0) / per_round)
            results[name]["wall"].append((time.perf_counter() - wall0) / per_round)
        done += per_round
    source.close()
    out: dict[str, Any] = {"gpus": gpus, "cycles_each": done, "errors": errors[:20],
                           "error_count": len(errors)}
    for name, r in results.items():
        if r["cpu"]:
            out[f"{name}_cpu_s_per_cycle"] = statistics.median(r["cpu"])
            out[f"{name}_wall_s_per_cycle"] = statistics.median(r["wall"])
    if out.get("bare_cpu_s_per_cycle"):
        out["cpu_ratio_gpumon_to_bare"] = out["gpumon_cpu_s_per_cycle"] / out["bare_cpu_s_per_cycle"]
    if gpus and "gpumon_cpu_s_per_cycle" in out:
        out["gpumon_cpu_s_per_cycle_per_gpu"] = out["gpumon_cpu_s_per_cycle"] / gpus
    return out


# ----------------------------------------------------------------------------------------
# NVML mode: the real library, or the fake one for a dry run
# ----------------------------------------------------------------------------------------

def nvml_environment(mode: str, scratch: Path, report: Report) -> dict[str, str]:
    """The environment for child processes that use NVML (agent, probe)."""
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
    from gpumon.testing.fakenvml import build_fake_nvml

    lib = build_fake_nvml(scratch / "fakenvml")
    scenario = scratch / "h200_dry_run.scn"
    scenario.write_text(FAKE_SCENARIO.format(pid=os.getpid()))
    env["LD_LIBRARY_PATH"] = str(lib.parent)
    env["FAKE_NVML_SCENARIO"] = str(scenario)
    print(f"  NVML: the FAKE library {lib} (dry run), scenario {scenario}", flush=True)
    return env


def add_import_shims(env: dict[str, str], scratch: Path, report: Report) -> list[str]:
    """The agent imports bcrypt and yaml (web config) at start; if this machine lacks them
    (no network to install them), stand-ins let the agent start without a web config."""
    missing = []
    for module in ("bcrypt", "yaml"):
        probe = run_cmd([sys.executable, "-c", f"import {module}"], 30, env)
        if probe["rc"] != 0:
            missing.append(module)
    if not missing:
        return missing
    shims = scratch / "shims"
    shims.mkdir(exist_ok=True)
    if "bcrypt" in missing:
        (shims / "bcrypt.py").write_text(
            "# gpu_node_check stand-in: bcrypt is not installed on this machine\n"
            "def gensalt(rounds=12, prefix=b'2b'):\n    return b'$2b$10$' + b'.' * 22\n"
            "def hashpw(password, salt):\n    return salt + b'.' * 31\n"
            "def checkpw(password, hashed):\n    return False\n")
    if "yaml" in missing:
        (shims / "yaml.py").write_text(
            "# gpu_node_check stand-in: PyYAML is not installed on this machine\n"
            "class YAMLError(Exception):\n    pass\n"
            "def safe_load(*args, **kwargs):\n"
            "    raise YAMLError('PyYAML is not installed (gpu_node_check stand-in)')\n")
    env["PYTHONPATH"] = str(shims) + os.pathsep + env["PYTHONPATH"]
    report.finding(f"the agent needs {', '.join(missing)} (imported at start by "
                   "gpumon.export.webconfig even without --web-config); not installed here, "
                   "so stand-in modules were put on the agent's PYTHONPATH")
    return missing


# ----------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------

def section_environment(report: Report, result: dict[str, Any]) -> Any:
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
        result["hook_core"] = IMPLEMENTATION  # "c" where setup.py built gpumon.client._hook
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


def section_nvml(report: Report, result: dict[str, Any], env: dict[str, str],
                 scratch: Path) -> dict[str, Any] | None:
    limit = min(75.0, max(20.0, report.remaining() - 150.0))  # a normal run takes ~10 s
    argv = [sys.executable, str(Path(__file__).resolve()), "--nvml-child",
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
        essential = ("utilization_ratio", "memory_used_bytes", "power_watts",
                     "temperature_celsius", "sm_clock_hz")
        report.check(f"nvml.gpu{gpu['index']}.essentials", all(k in gpu["populated"]
                                                                for k in essential),
                     {k: gpu["populated"].get(k) for k in essential})
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


class Agent:
    def __init__(self, report: Report, env: dict[str, str], scratch: Path) -> None:
        self.port = free_port()
        self.socket = scratch / "ingest.sock"
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = report.out / "agent.log"
        argv = [sys.executable, "-m", "gpumon.cli", "agent", "--address", "127.0.0.1",
                "--port", str(self.port), "--socket", str(self.socket), "--interval", "1.0",
                "--record", str(report.out / "recording.jsonl"), "--log-level", "info"]
        self.argv = argv
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=ROOT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        report.children.append(self.proc)

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = now() + timeout
        last: Any = None
        while now() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                code, body = get_text(self.url + "/readyz", 2.0)
                last = (code, body)
                if code == 200:
                    return {"readyz": json.loads(body)}
            except (OSError, ValueError) as exc:
                last = repr(exc)
            time.sleep(0.2)
        raise RuntimeError(f"agent not ready within {timeout:.0f} s: {last}")

    def scrape(self) -> str:
        code, body = get_text(self.url + "/metrics", 10.0)
        if code != 200:
            raise RuntimeError(f"/metrics answered {code}")
        return body

    def cpu_seconds(self) -> float | None:
        try:
            import psutil

            t = psutil.Process(self.proc.pid).cpu_times()
            return float(t.user + t.system)
        except Exception:
            return None

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(Exception):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


class Workload:
    """A model, its optimizer and endless synthetic batches, on CUDA or the CPU."""

    def __init__(self, torch: Any, kind: str, device: str) -> None:
        from torch import nn

        self.torch = torch
        self.device = device
        self.kind = kind
        cuda = device == "cuda"
        torch.manual_seed(0)
        if kind == "transformer":
            d, layers, heads, self.seq, self.batch, self.vocab = (
                (1024, 8, 16, 512, 16, 8192) if cuda else (64, 2, 4, 32, 8, 256))
            layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                               norm_first=True)
            self.model = nn.Sequential(
                nn.Embedding(self.vocab, d),
                nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                nn.Linear(d, self.vocab),
            ).to(device)
            self.batches = [
                (torch.randint(0, self.vocab, (self.batch, self.seq), device=device),
                 torch.randint(0, self.vocab, (self.batch, self.seq), device=device))
                for _ in range(4)]
            self.tokens = self.batch * self.seq
        else:  # a small MLP: launch-bound, where the hook's own cost would show
            width, self.batch = 256, 64
            self.model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(width, width),
                                                                       nn.ReLU())),
                                       nn.Linear(width, 10)).to(device)
            self.batches = [(torch.randn(self.batch, width, device=device),
                             torch.randint(0, 10, (self.batch,), device=device))
                            for _ in range(4)]
            self.tokens = self.batch
        self.params = sum(p.numel() for p in self.model.parameters())
        self.flops = 6.0 * self.params * self.tokens
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda
                         else contextlib.nullcontext())
        self._i = 0

    def data(self) -> Iterator[tuple[Any, Any]]:
        while True:
            self._i += 1
            yield self.batches[self._i % len(self.batches)]

    def loss(self, x: Any, y: Any) -> Any:
        F = self.torch.nn.functional  # noqa: N806
        with self.autocast:
            out = self.model(x)
            if self.kind == "transformer":
                return F.cross_entropy(out.view(-1, self.vocab).float(), y.view(-1))
            return F.cross_entropy(out.float(), y)

    def train(self, steps: int, mon: Any = None, memory: dict[str, int] | None = None) -> None:
        data = self.data()
        opt = self.optimizer
        if mon is None:
            for _ in range(steps):
                x, y = next(data)
                loss = self.loss(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return
        for k, (x, y) in enumerate(mon.loader(data)):
            if k >= steps:
                break
            with mon.step(samples=self.batch, tokens=self.tokens, flops=self.flops, memory=memory):
                with mon.phase("forward"):
                    loss = self.loss(x, y)
                with mon.phase("backward"):
                    loss.backward()
                with mon.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def read_recording(path: Path) -> list[dict[str, Any]]:
    lines = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                lines.append(json.loads(line))
    return lines


def section_training(report: Report, result: dict[str, Any], torch: Any, agent: Agent,
                     device: str) -> Any:
    from gpumon.analysis.devices import resolve_peak_flops
    from gpumon.client import StepMonitor

    work = Workload(torch, "transformer", device)
    result["model"] = {"kind": "transformer", "params": work.params, "tokens_per_step": work.tokens,
                       "flops_per_step": work.flops, "device": device}
    work.train(10)  # warm-up, bare (cuBLAS handles, allocator)
    work.sync()
    mon = StepMonitor(RUN, socket_path=str(agent.socket))
    result["monitor"] = {"cuda_clock": mon._cuda is not None, "gpu": mon.gpu,
                         "rank": mon.rank, "world": mon.world}
    report.check("hook.cuda_event_timing_active", (mon._cuda is not None) if device == "cuda" else None,
                 {"cuda_clock": mon._cuda is not None, "reported_gpu": mon.gpu})

    min_steps, min_s, max_s = (300, 10.0, 40.0) if device == "cuda" else (60, 6.0, 20.0)
    mid: dict[str, Any] = {}
    stop_mid = threading.Event()

    def mid_training_scrape() -> None:
        if stop_mid.wait(min_s * 0.6):
            return
        try:
            text = agent.scrape()
            (report.out / "metrics_mid_training.txt").write_text(text)
            mid["samples"] = parse_metrics(text)
            mid["t"] = time.time()
        except Exception:
            mid["error"] = tb()

    scraper = threading.Thread(target=mid_training_scrape, name="mid-scrape", daemon=True)
    agent_cpu0, wall0, t_start = agent.cpu_seconds(), time.perf_counter(), time.time()
    scraper.start()
    steps = 0
    while (steps < min_steps or time.perf_counter() - wall0 < min_s) and \
            time.perf_counter() - wall0 < max_s and steps < 20000:
        work.train(10, mon)
        steps += 10
    work.sync()
    wall = time.perf_counter() - wall0
    t_end = time.time()
    stop_mid.set()
    scraper.join(timeout=15)
    agent_cpu1 = agent.cpu_seconds()
    mon.flush()
    result["training"] = {"steps": steps, "wall_s": wall, "steps_per_s": steps / wall,
                          "t_start": t_start, "t_end": t_end}
    if agent_cpu0 is not None and agent_cpu1 is not None:
        result["agent_cpu_ratio_during_training"] = (agent_cpu1 - agent_cpu0) / wall
    if device == "cuda":
        result["torch_memory_end"] = {"allocated": torch.cuda.memory_allocated(),
                                      "reserved": torch.cuda.memory_reserved(),
                                      "max_allocated": torch.cuda.max_memory_allocated()}
    # Wait for every record, then for a verdict.
    deadline = now() + 15
    text = ""
    samples: Samples = []
    while now() < deadline:
        text = agent.scrape()
        samples = parse_metrics(text)
        got = first(samples, "gpumon_steps_total", run=RUN) or 0
        verdicts = select(samples, "gpumon_step_bottleneck", run=RUN)
        if got >= steps and verdicts and now() > deadline - 12:  # >= 3 s after the last step
            break
        time.sleep(0.5)
    (report.out / "metrics_after_training.txt").write_text(text)
    code, body = get_text(agent.url + "/api/v1/snapshot", 10)
    snapshot = json.loads(body) if code == 200 else {"status": code, "body": body[:500]}
    result["snapshot"] = snapshot
    stats = mon.stats
    result["client_stats"] = jsonable(stats)

    # Checks -------------------------------------------------------------------------------
    got = first(samples, "gpumon_steps_total", run=RUN)
    report.check("agent.steps_arrived", got == steps,
                 {"agent_steps_total": got, "steps_run": steps, "client_sent": stats.records_sent,
                  "client_dropped": stats.dropped,
                  "agent_dropped": {lab.get("reason"): v for lab, v in
                                    select(samples, "gpumon_ingest_dropped_total") if v}})
    current = {lab["bottleneck"]: v for lab, v in select(samples, "gpumon_step_bottleneck", run=RUN)}
    totals = {lab["bottleneck"]: v for lab, v in
              select(samples, "gpumon_step_bottleneck_total", run=RUN)}
    confidence = first(samples, "gpumon_step_bottleneck_confidence", run=RUN)
    report.check("agent.verdict_metrics", bool(current) and sum(current.values()) == 1
                 and confidence is not None,
                 {"current": [k for k, v in current.items() if v == 1], "confidence": confidence,
                  "steps_by_bottleneck": {k: v for k, v in totals.items() if v}})
    flags = {lab.get("flag"): v for lab, v in select(samples, "gpumon_step_flag", run=RUN)}
    ranks = snapshot.get("ranks", []) if isinstance(snapshot, dict) else []
    mine = next((r for r in ranks if r.get("run") == RUN), {})
    report.check("agent.verdict_detail", None, {"flags": flags, "analysis": mine.get("analysis")})
    # Phases: per-step sums from the recording (CUDA-event times + host data time) vs duration.
    recording = read_recording(report.out / "recording.jsonl")
    step_lines = [r for r in recording if r.get("kind") == "step" and r.get("run") == RUN]
    ratios, missing = [], 0
    for r in step_lines:
        phases = r.get("phases") or {}
        if not {"forward", "backward", "optimizer"} <= set(phases):
            missing += 1
            continue
        if r.get("duration"):
            ratios.append(sum(phases.values()) / r["duration"])
    phase_totals = {lab["phase"]: v for lab, v in
                    select(samples, "gpumon_step_phase_seconds_total", run=RUN)}
    duration_sum = first(samples, "gpumon_step_duration_seconds_sum", run=RUN)
    aggregate = (sum(phase_totals.values()) / duration_sum) if duration_sum else None
    median_ratio = statistics.median(ratios) if ratios else None
    report.check("hook.phase_sum_vs_step_time",
                 median_ratio is not None and 0.7 <= median_ratio <= 1.15 and missing == 0,
                 {"median_ratio": median_ratio, "p10": quantile(ratios, 0.1),
                  "p90": quantile(ratios, 0.9), "aggregate_ratio": aggregate,
                  "steps_missing_phases": missing, "steps_recorded": len(step_lines),
                  "phase_seconds_total": phase_totals, "duration_seconds_sum": duration_sum,
                  "wall_s": wall})
    mem = {name: first(samples, f"gpumon_torch_memory_{name}_bytes", run=RUN)
           for name in ("allocated", "reserved", "peak")}
    report.check("hook.torch_memory_metrics",
                 all(v is not None and v > 0 for v in mem.values()) if device == "cuda" else None,
                 {**mem, "torch_end": result.get("torch_memory_end")})
    # The rank's GPU: the UUID torch reports must be NVML's.
    gpu_info = select(samples, "gpumon_gpu_info")
    nvml_uuids = sorted(lab.get("uuid", "") for lab, _ in gpu_info)
    rank_gpu = [lab.get("gpu") for lab, _ in select(samples, "gpumon_rank_info", run=RUN)]
    report.check("agent.rank_attributed_to_nvml_gpu",
                 bool(rank_gpu) and rank_gpu[0] in nvml_uuids if device == "cuda" else None,
                 {"rank_info_gpu": rank_gpu, "nvml_uuids": nvml_uuids,
                  "client_reported": mon.gpu, "analysis_gpu_index": (mine.get("analysis") or {}).get("gpu")})
    # GPU busy while training: the recording's GPU samples in the training window, and the
    # gauges of the mid-training scrape.
    window = [r for r in recording if r.get("kind") == "gpu" and t_start + 1 <= r.get("t", 0) <= t_end]
    busy: dict[str, Any] = {"samples_in_window": len(window)}
    for key in ("utilization", "memory_utilization", "sm_active", "sm_occupancy", "tensor_active",
                "dram_active", "power_watts", "pcie_tx_bytes_per_second", "nvlink_tx_bytes_per_second"):
        vals = [r[key] for r in window if isinstance(r.get(key), (int, float))]
        if vals:
            busy[key] = {"median": statistics.median(vals), "max": max(vals)}
    mid_samples = mid.get("samples") or []
    busy["mid_scrape"] = {name: first(mid_samples, name, gpu="0") for name in (
        "gpumon_gpu_utilization_ratio", "gpumon_gpu_sm_active_ratio",
        "gpumon_gpu_tensor_active_ratio", "gpumon_gpu_dram_active_ratio",
        "gpumon_gpu_power_watts", "gpumon_gpu_sm_clock_hertz", "gpumon_gpu_memory_used_bytes")}
    if mid.get("error"):
        busy["mid_scrape_error"] = mid["error"]
    util_max = (busy.get("utilization") or {}).get("max")
    report.check("agent.gpu_busy_during_training",
                 util_max is not None and util_max > 0.3 if device == "cuda" else None, busy)
    # MFU against our own arithmetic.
    name = snapshot.get("gpus", [{}])[0].get("model") if isinstance(snapshot, dict) and \
        snapshot.get("gpus") else None
    peak = resolve_peak_flops(name, None) if name else None
    own_mfu = (work.flops * steps / wall / peak) if peak else None
    report.check("agent.mfu", None, {"gpumon_step_mfu_ratio": first(samples, "gpumon_step_mfu_ratio",
                                                                     run=RUN),
                                     "own_estimate": own_mfu, "peak_flops_used": peak,
                                     "device_name": name})
    pid = str(os.getpid())
    report.check("agent.process_memory_by_pid",
                 bool(select(samples, "gpumon_gpu_process_memory_bytes", pid=pid))
                 if device == "cuda" else None,
                 {"pids_seen": [lab.get("pid") for lab, _ in
                                select(samples, "gpumon_gpu_process_memory_bytes")], "our_pid": pid})
    report.check("agent.process_cpu_metrics",
                 first(samples, "gpumon_process_cpu_seconds_total", run=RUN) is not None,
                 first(samples, "gpumon_process_cpu_seconds_total", run=RUN))
    errors = {f"{lab.get('collector')}:{lab.get('error')}": v
              for lab, v in select(samples, "gpumon_collector_errors_total") if v}
    report.check("agent.no_collector_errors", not errors, errors)
    durations = {lab.get("collector"): v for lab, v in
                 select(samples, "gpumon_collector_duration_seconds")}
    report.check("agent.collector_durations", None, durations)
    report.check("agent.cpu_during_training", None, result.get("agent_cpu_ratio_during_training"))
    return work, mon


def section_endpoints(report: Report, result: dict[str, Any], agent: Agent) -> None:
    for path in ("/healthz", "/readyz", "/"):
        try:
            code, body = get_text(agent.url + path, 5)
            result[path] = {"status": code, "body": body[:400]}
        except Exception as exc:
            result[path] = {"error": repr(exc)}
    report.check("agent.healthz", result["/healthz"].get("status") == 200, result["/healthz"])
    report.check("agent.readyz", result["/readyz"].get("status") == 200, result["/readyz"])


def section_overhead(report: Report, result: dict[str, Any], torch: Any, device: str,
                     work: Workload | None, mon: Any) -> None:
    """Alternating blocks with and without the hook on the same model and monitor."""
    cuda = device == "cuda"
    plans = [("transformer", work, 15 if cuda else 4, 50 if cuda else 10),
             ("mlp", None, 15 if cuda else 4, 50 if cuda else 20)]
    for name, existing, pairs, block in plans:
        if report.remaining() < 40:
            result[name] = "skipped: out of time"
            continue
        w = existing or Workload(torch, name, device)
        w.train(5, mon)
        w.train(5)
        w.sync()
        ratios, hooked_s, bare_s = [], [], []
        for k in range(pairs):
            if report.remaining() < 30:
                break
            times = {}
            order = ("bare", "hooked") if k % 2 == 0 else ("hooked", "bare")
            for kind in order:
                w.sync()
                t0 = time.perf_counter()
                if kind == "hooked":
                    w.train(block, mon)
                    w.sync()
                    mon.flush()  # everything the sender does for these steps, billed here
                else:
                    w.train(block)
                    w.sync()
                times[kind] = time.perf_counter() - t0
            ratios.append(times["bare"] / times["hooked"])  # hooked/bare throughput
            hooked_s.append(times["hooked"] / block)
            bare_s.append(times["bare"] / block)
        if not ratios:
            result[name] = "skipped: out of time"
            continue
        per_step_cost = [h - b for h, b in zip(hooked_s, bare_s, strict=True)]
        result[name] = {
            "pairs": len(ratios), "block_steps": block, "params": w.params,
            "median_throughput_ratio_hooked_to_bare": statistics.median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios),
            "median_bare_step_s": statistics.median(bare_s),
            "median_hooked_step_s": statistics.median(hooked_s),
            "median_extra_s_per_step": statistics.median(per_step_cost),
            "ratios": [round(r, 4) for r in ratios],
        }
        report.check(f"overhead.{name}", None, {k: v for k, v in result[name].items() if k != "ratios"})


def section_oom(report: Report, result: dict[str, Any], torch: Any, agent: Agent,
                device: str) -> None:
    """Hold device memory in growing chunks (at most ~85 % of NVML's total), steps running.

    Without CUDA (dry run) nothing is allocated: the steps report the memory they would hold
    (``StepMonitor.step(memory=...)``, against the fake H200's capacity), which exercises the
    loop, the agent's OOM analysis, the polling and the report; its checks are informational.
    """
    from gpumon.client import StepMonitor

    cuda = device == "cuda"
    work = Workload(torch, "mlp", device)
    mon = StepMonitor(OOM_RUN, socket_path=str(agent.socket))
    if cuda:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used_now = total - free
        budget = int(MAX_MEMORY_SHARE * total) - used_now - 1 * GIB
        if budget < 4 * GIB:
            raise SkipSection(f"only {budget / GIB:.1f} GiB could be held under "
                              f"{MAX_MEMORY_SHARE:.0%}")
    else:
        total, used_now = 150754820096, GIB  # the dry run's fake H200
        budget = int(MAX_MEMORY_SHARE * total) - used_now - 1 * GIB
    result["memory"] = {"total": total, "used_before": used_now, "to_hold": budget,
                        "max_share": MAX_MEMORY_SHARE}
    chunks, grow_s, hold_s, after_s = 16, 8.0, 4.0, 8.0
    chunk = budget // chunks
    held: list[Any] = []
    series: list[dict[str, Any]] = []
    best: dict[str, Any] = {"risk": -1.0, "text": ""}
    stop = threading.Event()
    t0_unix = time.time()

    def poll() -> None:
        while not stop.wait(1.0):
            try:
                text = agent.scrape()
            except Exception as exc:
                series.append({"error": repr(exc)})
                continue
            m = parse_metrics(text)
            risk = first(m, "gpumon_oom_risk_ratio", run=OOM_RUN)
            series.append({
                "t": round(time.time() - t0_unix, 1), "held_gib": round(len(held) * chunk / GIB, 2),
                "risk": risk,
                "predicted_s": first(m, "gpumon_oom_predicted_seconds", run=OOM_RUN),
                "headroom_gib": gib(first(m, "gpumon_oom_headroom_bytes", run=OOM_RUN)),
                "nvml_used_gib": gib(first(m, "gpumon_gpu_memory_used_bytes", gpu="0")),
                "torch_reserved_gib": gib(first(m, "gpumon_torch_memory_reserved_bytes",
                                                run=OOM_RUN)),
            })
            if risk is not None and risk > best["risk"]:
                best.update(risk=risk, text=text)

    poller = threading.Thread(target=poll, name="oom-poll", daemon=True)
    poller.start()
    try:
        start = time.perf_counter()
        while time.perf_counter() - start < grow_s + hold_s:
            elapsed = time.perf_counter() - start
            if len(held) < chunks and elapsed >= len(held) * grow_s / chunks:
                held.append(torch.empty(chunk, dtype=torch.uint8, device=device) if cuda else None)
            pretend = None if cuda else {"allocated": len(held) * chunk,
                                         "reserved": len(held) * chunk, "peak": len(held) * chunk}
            work.train(2, mon, pretend)
            time.sleep(0.005)  # ~200 steps/s at most: the recording stays small
        work.sync()
        result["held_max_bytes"] = len(held) * chunk
        held.clear()
        if cuda:
            torch.cuda.empty_cache()
        start = time.perf_counter()
        while time.perf_counter() - start < after_s:
            work.train(2, mon, None if cuda else {"allocated": 0, "reserved": 0, "peak": 0})
            time.sleep(0.005)
        work.sync()
        mon.flush()
        time.sleep(2.5)
    finally:
        held.clear()
        if cuda:
            torch.cuda.empty_cache()
        stop.set()
        poller.join(timeout=5)
        mon.close()
    if best["text"]:
        (report.out / "metrics_oom.txt").write_text(best["text"])
    result["series"] = series
    risks = [p["risk"] for p in series if p.get("risk") is not None]
    predicted = [p["predicted_s"] for p in series if p.get("predicted_s") is not None]
    report.check("oom.risk_rises_under_pressure", (bool(risks) and max(risks) >= 0.4) if cuda else None,
                 {"max_risk": max(risks) if risks else None, "last_risk": risks[-1] if risks else None,
                  "max_held_gib": round(result.get("held_max_bytes", 0) / GIB, 2)})
    report.check("oom.predicted_seconds_while_growing", bool(predicted) if cuda else None,
                 {"values": predicted[:12]})
    report.check("oom.risk_falls_after_free", (bool(risks) and risks[-1] < max(risks)) if cuda else None,
                 {"last": risks[-1] if risks else None})


def section_oom_event(report: Report, result: dict[str, Any], torch: Any, agent: Agent) -> None:
    """A raised (not allocated) torch.OutOfMemoryError through the hook's step: the oom event
    reaches the agent and counts in gpumon_torch_ooms_total. Needs no CUDA."""
    from gpumon.client import StepMonitor

    run = OOM_RUN + "-event"
    mon = StepMonitor(run, socket_path=str(agent.socket))
    with mon.step():
        pass  # one ordinary step first, so the rank exists with its counters
    mon.flush()
    time.sleep(1.5)
    before = first(parse_metrics(agent.scrape()), "gpumon_torch_ooms_total", run=run)
    with contextlib.suppress(torch.OutOfMemoryError):
        with mon.step():
            raise torch.OutOfMemoryError("gpu_node_check: simulated, no allocation was made")
    mon.flush()
    time.sleep(1.5)
    after = first(parse_metrics(agent.scrape()), "gpumon_torch_ooms_total", run=run)
    result.update(before=before, after=after, client_stats=jsonable(mon.stats))
    report.check("oom.event_counted", after is not None and after >= (before or 0) + 1,
                 {"before": before, "after": after})
    mon.close()


def section_replay(report: Report, result: dict[str, Any], env: dict[str, str]) -> None:
    rec = report.out / "recording.jsonl"
    proc = run_cmd([sys.executable, "-m", "gpumon.cli", "classify", str(rec), "--json"], 60, env)
    result["rc"] = proc["rc"]
    lines = proc["stdout"].splitlines()
    summary = None
    with contextlib.suppress(ValueError, IndexError):
        summary = json.loads(lines[-1]).get("summary")
    result["summary"] = summary
    result["stderr_tail"] = proc["stderr"][-2000:]
    result["recording_bytes"] = rec.stat().st_size if rec.exists() else None
    report.check("replay.classify_recording", proc["rc"] == 0 and summary is not None, summary)


def section_agent_stop(report: Report, result: dict[str, Any], agent: Agent) -> None:
    result["rc"] = agent.stop()
    log = agent.log_path.read_text(errors="replace") if agent.log_path.exists() else ""
    problems = [ln for ln in log.splitlines()
                if re.search(r"Traceback|ERROR|CRITICAL|Exception", ln)]
    result["log_problem_lines"] = problems[:40]
    result["log_tail"] = log.splitlines()[-40:]
    report.check("agent.clean_exit", result["rc"] == 0, result["rc"])
    report.check("agent.log_without_errors", not problems, problems[:10])
    rec = report.out / "recording.jsonl"
    if rec.exists():  # compressed: it is the largest file to bring back
        with open(rec, "rb") as src, gzip.open(str(rec) + ".gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        result["recording"] = {"bytes": rec.stat().st_size,
                               "gz_bytes": Path(str(rec) + ".gz").stat().st_size}
        rec.unlink()


# ----------------------------------------------------------------------------------------
# summary.md
# ----------------------------------------------------------------------------------------

def write_markdown(report: Report) -> None:
    d = jsonable(report.data)
    lines = ["# gpumon GPU node check", ""]
    env = d["sections"].get("environment", {})
    smi = env.get("nvidia_smi")
    torch_info = env.get("torch", {})
    lines += [f"- NVML mode: **{d.get('nvml_mode')}**; elapsed {d.get('elapsed_s')} s "
              f"of a {d.get('budget_s')} s budget",
              f"- nvidia-smi: {json.dumps(smi.get('excerpt') if isinstance(smi, dict) else smi)}",
              f"- torch: {json.dumps(torch_info)}",
              f"- packages: {json.dumps(env.get('packages'))}", ""]
    if d.get("watchdog"):
        lines += [f"**WATCHDOG fired at {d['watchdog']['fired_at_s']} s** (stacks in summary.json)", ""]
    lines += ["## Sections", "", "| section | status | seconds |", "|---|---|---|"]
    for name, sec in d["sections"].items():
        lines.append(f"| {name} | {sec.get('status', 'running?')} | {sec.get('seconds', '')} |")
    lines += ["", "## Checks", "", "| check | result | detail |", "|---|---|---|"]
    for name, c in d["checks"].items():
        mark = {True: "PASS", False: "**FAIL**", None: "info"}[c["ok"]]
        detail = json.dumps(c["detail"], default=str).replace("|", "\\|")
        lines.append(f"| {name} | {mark} | {detail[:600]} |")
    if d["findings"]:
        lines += ["", "## Findings", ""] + [f"- {f}" for f in d["findings"]]
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
    for name, sec in d["sections"].items():
        if sec.get("traceback"):
            lines += ["", f"## Traceback in {name}", "", "```", sec["traceback"], "```"]
    for exc in probe.get("exceptions", []):
        lines += ["", f"## Traceback in the NVML child: {exc['where']}", "", "```",
                  exc["traceback"], "```"]
    over = d["sections"].get("overhead", {})
    if over:
        lines += ["", "## Hook overhead (throughput hooked / bare, median of pairs)", ""]
        for name in ("transformer", "mlp"):
            o = over.get(name)
            if isinstance(o, dict):
                lines.append(f"- {name}: {o['median_throughput_ratio_hooked_to_bare']:.4f} "
                             f"(min {o['min_ratio']:.4f}, max {o['max_ratio']:.4f}; "
                             f"{o['pairs']} pairs of {o['block_steps']} steps; bare step "
                             f"{o['median_bare_step_s'] * 1e3:.3f} ms, extra per step "
                             f"{o['median_extra_s_per_step'] * 1e6:.1f} µs)")
    oom = d["sections"].get("oom", {})
    if oom.get("series"):
        lines += ["", "## OOM-risk series", "", "| t | held GiB | risk | predicted s | headroom GiB "
                  "| NVML used GiB | torch reserved GiB |", "|---|---|---|---|---|---|---|"]
        for p in oom["series"]:
            lines.append(f"| {p.get('t')} | {p.get('held_gib')} | {p.get('risk')} | "
                         f"{p.get('predicted_s')} | {p.get('headroom_gib')} | {p.get('nvml_used_gib')} "
                         f"| {p.get('torch_reserved_gib')} |")
    (report.out / "summary.md").write_text("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="the watchdog ends the script after this many seconds")
    parser.add_argument("--nvml", choices=("auto", "real", "fake"), default="auto",
                        help="real libnvidia-ml, the project's fake one (dry run), or auto: "
                             "real when libnvidia-ml.so.1 loads")
    parser.add_argument("--nvml-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cycles", type=int, default=200, help=argparse.SUPPRESS)
    parser.add_argument("--child-limit", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.nvml_child:
        print(json.dumps(jsonable(nvml_child(args.cycles, args.child_limit, str(args.out)))),
              flush=True)
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, args.budget_s)
    report.start_watchdog()
    scratch = Path(tempfile.mkdtemp(prefix="gpumon-node-check-"))
    st: dict[str, Any] = {"torch": None, "env": {}, "agent": None, "work": None, "mon": None,
                          "device": "cpu"}

    def environment(r: dict[str, Any]) -> None:
        st["torch"] = torch = section_environment(report, r)
        st["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        if st["device"] == "cpu":
            torch.set_num_threads(min(4, os.cpu_count() or 1))

    def nvml_setup(r: dict[str, Any]) -> None:
        st["env"] = nvml_environment(args.nvml, scratch, report)
        r["mode"] = report.data["nvml_mode"]
        r["agent_imports_missing"] = add_import_shims(st["env"], scratch, report)

    def agent_start(r: dict[str, Any]) -> None:
        st["agent"] = agent = Agent(report, st["env"], scratch)
        r["argv"] = agent.argv
        r.update(agent.wait_ready(30))
        time.sleep(1.5)  # a GPU sample and a host sample before the first steps

    def training(r: dict[str, Any]) -> None:
        if st["torch"] is None:
            raise SkipSection("torch did not import")
        if st["device"] == "cpu":
            r["note"] = "no CUDA: the loop ran on the CPU (dry run); CUDA checks are info only"
        st["work"], st["mon"] = section_training(report, r, st["torch"], st["agent"], st["device"])

    def overhead(r: dict[str, Any]) -> None:
        if st["mon"] is None:
            raise SkipSection("no monitor (the training section failed)")
        if st["device"] == "cpu":
            r["note"] = "no CUDA: CPU blocks (dry run), the ratios mean little"
        section_overhead(report, r, st["torch"], st["device"], st["work"], st["mon"])

    def oom(r: dict[str, Any]) -> None:
        if st["device"] != "cuda":
            r["note"] = "no CUDA: a few MiB of host memory (dry run of the code path)"
        section_oom(report, r, st["torch"], st["agent"], st["device"])

    try:
        report.run("environment", environment)
        report.run("nvml_setup", nvml_setup)
        if st["env"]:
            report.run("nvml", lambda r: section_nvml(report, r, st["env"], scratch), need_s=30)
            report.run("agent_start", agent_start, need_s=60)
        agent = st["agent"]
        if agent is not None and agent.proc.poll() is None:
            report.run("training", training, need_s=50)
            report.run("endpoints", lambda r: section_endpoints(report, r, agent))
            report.run("overhead", overhead, need_s=45)
            report.run("oom", oom, need_s=35)
            report.run("oom_event", lambda r: section_oom_event(report, r, st["torch"], agent),
                       need_s=10)
            if st["mon"] is not None:
                st["mon"].close()
            report.run("replay", lambda r: section_replay(report, r, st["env"]), need_s=10)
        else:
            report.data["aborted"] = "no running agent: training, overhead and OOM not run"
    finally:
        if st["agent"] is not None:
            report.run("agent_stop", lambda r: section_agent_stop(report, r, st["agent"]))
        shutil.rmtree(scratch, ignore_errors=True)
        report.write()
        try:
            write_markdown(report)
        except Exception:
            print(f"summary.md failed:\n{tb()}", flush=True)
    checks = report.data["checks"]
    failed = [n for n, c in checks.items() if c["ok"] is False]
    errors = [n for n, s in report.data["sections"].items() if s.get("status") == "error"]
    print(f"\nDONE in {now() - report.t0:.0f} s: {len(checks)} checks, "
          f"{sum(1 for c in checks.values() if c['ok'])} passed, {len(failed)} failed "
          f"{failed}; section errors {errors}; results in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
