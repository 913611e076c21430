"""The NVML probe, run in a child process of the device script (the real libnvidia-ml, or the
fake one through the environment): gpumon's own NvmlSource on the library (statics, which
GpuSample fields are populated, groups found NOT_SUPPORTED, collector errors, the XID watcher),
every raw NVML call gpumon relies on with its return code and wall time, the GPM metrics one by
one, ``gpumon doctor``'s report, and the CPU cost of one collection cycle against the bare
pynvml calls. A child, because pynvml keeps the library it loaded for the life of a process."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumon.testing import free_port

from .report import jsonable, now, tb


def nvml_child(cycles: int, time_limit_s: float, scratch: str) -> dict[str, Any]:
    """Everything the probe found, as JSON data; exceptions are recorded, never raised."""
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
                # The fast set's plan as it stands after the polls: which reads are one
                # prepared call (True) and which go through the general path (False).
                "prepared_reads": {group: call is not None
                                   for group, _, call in getattr(device, "_plan", None) or ()},
                "samples_taken": len(mine),
            })
        out["gpumon_samples"] = per_gpu
        # XID events: registered, then taken with the polls (none expected); one look at the
        # quiet set without waiting, and one prepared wait of 1 s, which returns at its timeout.
        try:
            xids: list[tuple[int, int]] = []
            watching = source.watch_xids(lambda gpu, xid: xids.append((gpu, xid)))
            events = source._xids
            out["xid_watcher"] = {"watching": watching,
                                  "registered": events.registered if events else []}
            if events is not None and watching:
                for timeout_ms, key in ((0, "quiet_check"), (1000, "quiet_wait")):
                    look = events.prepared_check(timeout_ms)
                    began = now()
                    answer = look()
                    out["xid_watcher"][key] = {
                        "event": answer is not None, "seconds": round(now() - began, 3)}
            out["xid_watcher"]["events"] = xids
        except Exception:
            failed("XidEvents")
        # The agent's cycle: the polling thread hands every GPU's sample on itself.
        try:
            import threading
            handed: list[tuple[str, list[int]]] = []
            lock = threading.Lock()

            def deliver(batch: list[Any]) -> None:
                with lock:
                    handed.append((threading.current_thread().name, [s.index for s in batch]))

            for _ in range(3):
                source.poll(time.time(), now(), deliver)
                time.sleep(0.5)
            out["stream"] = {"devices": [d.index for d in source.devices],
                             "handed": handed}
        except Exception:
            failed("NvmlSource.poll()")
        # The agent's cycle as the agent runs it: the shared round on the asking thread,
        # watched by the timerfd watchdog, which must not fire on a healthy node.
        try:
            inline_source = gnvml.NvmlSource(on_error)
            inline: list[tuple[str, list[int]]] = []
            handed_over: list[str] = []

            def deliver_inline(batch: list[Any]) -> None:
                inline.append((threading.current_thread().name, [s.index for s in batch]))

            for _ in range(3):
                inline_source.poll(time.time(), now(), deliver_inline,
                                   lambda: handed_over.append(threading.current_thread().name))
                time.sleep(0.5)
            out["inline_stream"] = {"devices": [d.index for d in inline_source.devices],
                                    "handed": inline, "hand_overs": handed_over,
                                    "caller": threading.current_thread().name,
                                    "watchdog": inline_source._pollers._watchdog is not None}
            inline_source.close()
        except Exception:
            failed("NvmlSource.poll(hand_over)")
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
                        item["value"] = gnvml.device._field_value(entry)
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

