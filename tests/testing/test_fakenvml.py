"""The fake libnvidia-ml.so.1 seen through the unmodified pynvml binding.

pynvml caches the loaded library in a module global, so every check runs in a
fresh ``python -c`` child with LD_LIBRARY_PATH and FAKE_NVML_SCENARIO set; the
child prints one JSON document that the test compares with the scenario file
(read with gpumon.testing.fakenvml.Scenario).  Timing checks use generous bounds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gpumon.testing.fakenvml import (
    GPM_METRICS,
    SCENARIOS,
    FakeNvmlBuildError,
    Scenario,
    build_fake_nvml,
    fake_nvml_env,
    gpu_defaults,
)
from tests.testing.fakenvml_fixtures import fake_nvml_lib, fake_nvml_old_lib  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
ALL_LINKS = 0xFFFFFFFF

PRELUDE = """
import json, os, sys, threading, time
import pynvml as N
ALL = 0xFFFFFFFF
def out(obj):
    print("@@" + json.dumps(obj), flush=True)
def text(x):
    return x.decode() if isinstance(x, bytes) else x
def err(fn, *args):
    try:
        fn(*args)
    except N.NVMLError as e:
        return type(e).__name__
    return None
def fields(h, ids):
    return [(v.fieldId, v.scopeId, v.nvmlReturn, v.valueType, v.value.ullVal, v.timestamp)
            for v in N.nvmlDeviceGetFieldValues(h, ids)]
def gpm_pair(h, ids, gap=0.05):
    s1, s2 = N.nvmlGpmSampleAlloc(), N.nvmlGpmSampleAlloc()
    N.nvmlGpmSampleGet(h, s1)
    time.sleep(gap)
    N.nvmlGpmSampleGet(h, s2)
    mg = N.c_nvmlGpmMetricsGet_t()
    mg.version = N.NVML_GPM_METRICS_GET_VERSION
    mg.numMetrics = len(ids)
    mg.sample1, mg.sample2 = s1, s2
    for k, mid in enumerate(ids):
        mg.metrics[k].metricId = mid
    N.nvmlGpmMetricsGet(mg)
    res = {str(mid): [mg.metrics[k].nvmlReturn, mg.metrics[k].value] for k, mid in enumerate(ids)}
    N.nvmlGpmSampleFree(s1)
    N.nvmlGpmSampleFree(s2)
    return res
"""


def run_child(
    lib: Path | None,
    scenario: Path | str | None,
    body: str,
    *,
    timeout: float = 60,
    extra_env: dict[str, str] | None = None,
) -> Any:
    """Run ``body`` (after PRELUDE) in a fresh interpreter; return what it out()s last."""
    env = fake_nvml_env(lib, scenario)
    env.update(extra_env or {})
    code = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr}"
    docs = [line[2:] for line in proc.stdout.splitlines() if line.startswith("@@")]
    assert docs, f"child printed nothing:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(docs[-1])
    if isinstance(result, dict):
        result.setdefault("_stderr", proc.stderr)
    return result


# ---------------------------------------------------------------------------
# build helper and scenario helper
# ---------------------------------------------------------------------------


def test_build_is_cached_and_tracks_flags(tmp_path: Path) -> None:
    lib = build_fake_nvml(tmp_path / "x")
    assert lib == tmp_path / "x" / "libnvidia-ml.so.1" and lib.is_file()
    first = lib.stat().st_mtime_ns
    assert build_fake_nvml(tmp_path / "x") == lib
    assert lib.stat().st_mtime_ns == first  # up to date: not rebuilt
    build_fake_nvml(tmp_path / "x", old_driver=True)  # other flags: rebuilt
    assert "-DFAKE_NVML_OLD_DRIVER" in (tmp_path / "x" / "libnvidia-ml.so.1.flags").read_text()
    assert not list((tmp_path / "x").glob(".build-*"))


def test_build_without_compiler_fails_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-c-compiler-for-fakenvml")
    with pytest.raises(FakeNvmlBuildError, match="not found"):
        build_fake_nvml(tmp_path / "nocc")


def test_shipped_scenarios_parse_and_round_trip() -> None:
    names = {p.name for p in SCENARIOS.glob("*.scn")}
    assert {
        "h100_8x.scn", "h100_8x_live.scn", "pcie_consumer.scn", "gpu_lost.scn", "xid79.scn",
        "old_driver.scn", "hang.scn", "driver_not_loaded.scn",
    } <= names
    for name in names:
        scn = Scenario.load(SCENARIOS / name)
        assert Scenario.loads(scn.dumps()) == scn, name
    golden = Scenario.load(SCENARIOS / "h100_8x.scn")
    assert golden.gpu_count == 8
    for key in ("uuid", "pci_bus_id", "power_mw", "memory_used", "nvlink_tx_kib", "gpm_sm_util"):
        assert len({golden.gpu(i)[key] for i in range(8)}) == 8, key
    for i in range(8):
        for rate in ("nvlink_tx_kib_per_s", "nvlink_rx_kib_per_s", "pcie_tx_bytes_per_s",
                     "pcie_rx_bytes_per_s", "energy_mj_per_s"):
            assert golden.gpu(i).as_float(rate) == 0, (i, rate)


def test_dump_is_atomic_and_changes_mtime(tmp_path: Path) -> None:
    path = tmp_path / "s.scn"
    scn = Scenario.load(SCENARIOS / "xid79.scn")
    scn.dump(path)
    mtimes = [path.stat().st_mtime_ns]
    for util in (1, 2, 3):  # rewrites in quick succession
        scn.gpu(0)["util_gpu"] = util
        scn.dump(path)
        mtimes.append(path.stat().st_mtime_ns)
        assert Scenario.load(path).gpu(0).as_int("util_gpu") == util
    assert mtimes == sorted(set(mtimes))
    assert [p.name for p in tmp_path.iterdir()] == ["s.scn"]
    with pytest.raises(KeyError):
        scn.gpu(0)["no_such_key"] = 1


# ---------------------------------------------------------------------------
# golden: every value of the 8-GPU node, per index
# ---------------------------------------------------------------------------

GOLDEN_BODY = """
N.nvmlInit()
res = {"driver": N.nvmlSystemGetDriverVersion(), "nvml": N.nvmlSystemGetNVMLVersion(),
       "cuda": N.nvmlSystemGetCudaDriverVersion(), "cuda2": N.nvmlSystemGetCudaDriverVersion_v2(),
       "count": N.nvmlDeviceGetCount(), "gpus": []}
GPM_IDS = json.loads(os.environ["GPM_IDS"])
for i in range(res["count"]):
    h = N.nvmlDeviceGetHandleByIndex(i)
    pci = N.nvmlDeviceGetPciInfo_v3(h)
    m1 = N.nvmlDeviceGetMemoryInfo(h)
    m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
    u = N.nvmlDeviceGetUtilizationRates(h)
    ids = [91, (138, ALL), (139, ALL), 197, 198, 83] + [(138, l) for l in range(18)] \
        + [(139, l) for l in range(18)]
    res["gpus"].append({
        "index": N.nvmlDeviceGetIndex(h),
        "name": N.nvmlDeviceGetName(h),
        "uuid": N.nvmlDeviceGetUUID(h),
        "busId": text(pci.busId), "busIdLegacy": text(pci.busIdLegacy),
        "domain": pci.domain, "bus": pci.bus, "device": pci.device,
        "pciDeviceId": pci.pciDeviceId, "pciSubSystemId": pci.pciSubSystemId,
        "arch": N.nvmlDeviceGetArchitecture(h),
        "mig": N.nvmlDeviceGetMigMode(h),
        "mem1": [m1.total, m1.free, m1.used],
        "mem2": [m2.version, m2.total, m2.reserved, m2.free, m2.used],
        "util": [u.gpu, u.memory],
        "power": N.nvmlDeviceGetPowerUsage(h),
        "limit": N.nvmlDeviceGetPowerManagementLimit(h),
        "temp": N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU),
        "tempV": N.nvmlDeviceGetTemperatureV(h, N.NVML_TEMPERATURE_GPU),
        "clocks": [N.nvmlDeviceGetClockInfo(h, t) for t in range(4)],
        "max_clocks": [N.nvmlDeviceGetMaxClockInfo(h, t) for t in range(4)],
        "reasons": N.nvmlDeviceGetCurrentClocksEventReasons(h),
        "throttle": N.nvmlDeviceGetCurrentClocksThrottleReasons(h),
        "supported_reasons": N.nvmlDeviceGetSupportedClocksEventReasons(h),
        "ecc": [[N.nvmlDeviceGetTotalEccErrors(h, e, c) for c in (0, 1)] for e in (0, 1)],
        "fields": fields(h, ids),
        "procs": [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId]
                  for p in N.nvmlDeviceGetComputeRunningProcesses(h)],
        "procs_v2": [[p.pid, p.usedGpuMemory]
                     for p in N.nvmlDeviceGetComputeRunningProcesses_v2(h)],
        "gpm_supported": N.nvmlGpmQueryDeviceSupport(h).isSupportedDevice,
        "gpm": gpm_pair(h, GPM_IDS),
        "events": N.nvmlDeviceGetSupportedEventTypes(h),
    })
N.nvmlShutdown()
out(res)
"""


def test_golden_h100_8x(fake_nvml_lib: Path) -> None:  # noqa: F811
    scn = Scenario.load(SCENARIOS / "h100_8x.scn")
    gpm_ids = sorted(set(GPM_METRICS.values()) | {62, 97, 98})  # + per-link L0 RX, L17 TX, L18 RX
    res = run_child(fake_nvml_lib, SCENARIOS / "h100_8x.scn", GOLDEN_BODY,
                    extra_env={"GPM_IDS": json.dumps(gpm_ids)})
    assert res["driver"] == scn["driver_version"] == "550.54.15"
    assert res["nvml"] == scn["nvml_version"]
    assert res["cuda"] == res["cuda2"] == int(scn["cuda_driver_version"])
    assert res["count"] == 8
    for i, got in enumerate(res["gpus"]):
        g = scn.gpu(i)
        assert got["index"] == i
        assert got["name"] == g["name"] == "NVIDIA H100 80GB HBM3"
        assert got["uuid"] == g["uuid"]
        assert got["busId"] == g["pci_bus_id"]
        dom, bus, rest = g["pci_bus_id"].split(":")
        assert (got["domain"], got["bus"], got["device"]) == (int(dom, 16), int(bus, 16), 0)
        assert got["busIdLegacy"] == f"{int(dom, 16):04X}:{bus}:00.0"
        assert got["pciDeviceId"] == g.as_int("pci_device_id")
        assert got["pciSubSystemId"] == g.as_int("pci_subsystem_id")
        assert got["arch"] == g.as_int("architecture") == 9
        assert got["mig"] == [0, 0]
        total, used, reserved = (g.as_int(k) for k in ("memory_total", "memory_used",
                                                        "memory_reserved"))
        assert got["mem1"] == [total, total - used - reserved, used + reserved]
        assert got["mem2"] == [0x02000028, total, reserved, total - used - reserved, used]
        assert got["util"] == [g.as_int("util_gpu"), g.as_int("util_memory")]
        assert got["power"] == g.as_int("power_mw")
        assert got["limit"] == g.as_int("power_limit_mw")
        assert got["temp"] == got["tempV"] == g.as_int("temperature_c")
        assert got["clocks"] == [g.as_int(k) for k in (
            "graphics_clock_mhz", "sm_clock_mhz", "mem_clock_mhz", "video_clock_mhz")]
        assert got["max_clocks"] == [g.as_int(k) for k in (
            "max_graphics_clock_mhz", "max_sm_clock_mhz", "max_mem_clock_mhz",
            "max_video_clock_mhz")]
        assert got["reasons"] == got["throttle"] == g.as_int("clock_event_reasons")
        assert got["supported_reasons"] == g.as_int("supported_clock_event_reasons")
        assert got["ecc"] == [
            [g.as_int("ecc_corrected_volatile"), g.as_int("ecc_corrected_aggregate")],
            [g.as_int("ecc_uncorrected_volatile"), g.as_int("ecc_uncorrected_aggregate")],
        ]
        # field values: static counters are exact
        fv = {(f[0], f[1]): f for f in got["fields"]}
        assert all(f[2] == 0 and f[3] == 3 and f[5] > 1.6e15 for f in got["fields"])
        assert fv[(91, 0)][4] == g.as_int("nvlink_links") == 18
        assert fv[(138, ALL_LINKS)][4] == g.as_int("nvlink_tx_kib")
        assert fv[(139, ALL_LINKS)][4] == g.as_int("nvlink_rx_kib")
        assert fv[(197, 0)][4] == g.as_int("pcie_tx_bytes")
        assert fv[(198, 0)][4] == g.as_int("pcie_rx_bytes")
        assert fv[(83, 0)][4] == g.as_int("energy_mj")
        for fid, key in ((138, "nvlink_tx_kib"), (139, "nvlink_rx_kib")):
            per_link = [fv[(fid, link)][4] for link in range(18)]
            assert sum(per_link) == g.as_int(key)
            assert max(per_link) - min(per_link) <= 1
        assert [tuple(p[:2]) for p in got["procs"]] == g.processes
        assert all(p[2:] == [ALL_LINKS, ALL_LINKS] for p in got["procs"])  # no MIG
        assert [tuple(p) for p in got["procs_v2"]] == g.processes
        assert got["gpm_supported"] == 1
        for key, mid in GPM_METRICS.items():
            ret, value = got["gpm"][str(mid)]
            if key in g:
                assert ret == 0 and value == pytest.approx(g.as_float(key), rel=1e-9), key
            else:
                assert ret == 3, key  # NOT_SUPPORTED in the entry
        assert got["gpm"]["62"][0] == 0
        assert got["gpm"]["62"][1] == pytest.approx(g.as_float("gpm_nvlink_rx_mib_per_s") / 18)
        assert got["gpm"]["97"][1] == pytest.approx(g.as_float("gpm_nvlink_tx_mib_per_s") / 18)
        assert got["gpm"]["98"][0] == 3  # link 18 does not exist
        assert got["events"] & 0x8  # XID critical errors


# ---------------------------------------------------------------------------
# NVML conventions at the C level (ctypes, no pynvml wrappers)
# ---------------------------------------------------------------------------

CTYPES_BODY = """
import ctypes
from ctypes import byref, c_uint, c_int, c_ulonglong, c_void_p, c_char_p
L = ctypes.CDLL(os.environ["FAKE_LIB"])
L.nvmlErrorString.restype = c_char_p
r = {}
cnt = c_uint(0)
r["count_before_init"] = L.nvmlDeviceGetCount_v2(byref(cnt))
r["shutdown_before_init"] = L.nvmlShutdown()
r["strings"] = {k: L.nvmlErrorString(k).decode()
                for k in (0, 1, 2, 3, 7, 9, 10, 13, 15, 18, 25, 999, 4242)}
r["init"] = [L.nvmlInit_v2(), L.nvmlInitWithFlags(0)]
h, h2 = c_void_p(), c_void_p()
r["handle"] = [L.nvmlDeviceGetHandleByIndex_v2(0, byref(h)),
               L.nvmlDeviceGetHandleByIndex_v2(0, byref(h2)), h.value == h2.value,
               L.nvmlDeviceGetHandleByIndex_v2(99, byref(h2))]
buf = ctypes.create_string_buffer(96)
r["name"] = [L.nvmlDeviceGetName(h, buf, 96), buf.value.decode()]
n = len(buf.value)
r["name_exact"] = L.nvmlDeviceGetName(h, buf, n + 1)
r["name_short"] = L.nvmlDeviceGetName(h, buf, n)
r["name_null"] = L.nvmlDeviceGetName(h, None, 96)
r["bad_handle"] = L.nvmlDeviceGetName(c_void_p(12345), buf, 96)
r["driver_short"] = L.nvmlSystemGetDriverVersion(buf, 4)
P = N.c_nvmlProcessInfo_v3_t
fn = L.nvmlDeviceGetComputeRunningProcesses_v3
c0 = c_uint(0); r1 = fn(h, byref(c0), None)
c1 = c_uint(1); r2 = fn(h, byref(c1), (P * 1)())
arr = (P * 5)(); c5 = c_uint(5); r3 = fn(h, byref(c5), arr)
r["procs"] = [[r1, c0.value], [r2, c1.value], [r3, c5.value, [arr[k].pid for k in range(c5.value)]]]
fv = (N.c_nvmlFieldValue_t * 1)()
r["fields_zero"] = L.nvmlDeviceGetFieldValues(h, c_int(0), fv)
r["fields_negative"] = L.nvmlDeviceGetFieldValues(h, c_int(-1), fv)
m = N.c_nvmlMemory_v2_t(); m.version = 0x01000028
r["mem_v2_bad_version"] = L.nvmlDeviceGetMemoryInfo_v2(h, byref(m))
t = N.c_nvmlTemperature_v1_t(); t.version = 0x200000C
r["temp_bad_version"] = L.nvmlDeviceGetTemperatureV(h, byref(t))
t.version = N.nvmlTemperature_v1; t.sensorType = 0
r["temp_ok"] = [L.nvmlDeviceGetTemperatureV(h, byref(t)), t.temperature]
gs = N.c_nvmlGpmSupport_t(); gs.version = 2
r["gpm_support_bad_version"] = L.nvmlGpmQueryDeviceSupport(h, byref(gs))
mg = N.c_nvmlGpmMetricsGet_t(); mg.version = 2
r["gpm_get_bad_version"] = L.nvmlGpmMetricsGet(byref(mg))
mg.version = 1
r["gpm_get_no_samples"] = L.nvmlGpmMetricsGet(byref(mg))
r["ecc_bad_type"] = L.nvmlDeviceGetTotalEccErrors(h, 2, 0, byref(c_ulonglong()))
r["clock_bad_type"] = L.nvmlDeviceGetClockInfo(h, 7, byref(c_uint()))
r["shutdown"] = [L.nvmlShutdown(), L.nvmlDeviceGetCount_v2(byref(cnt)), cnt.value]
r["shutdown_last"] = [L.nvmlShutdown(), L.nvmlDeviceGetCount_v2(byref(cnt)),
                      L.nvmlDeviceGetName(h, buf, 96), L.nvmlShutdown()]
out(r)
"""


def test_nvml_conventions_at_c_level(fake_nvml_lib: Path) -> None:  # noqa: F811
    scn = Scenario.load(SCENARIOS / "h100_8x.scn")
    r = run_child(None, SCENARIOS / "h100_8x.scn", CTYPES_BODY,
                  extra_env={"FAKE_LIB": str(fake_nvml_lib)})
    assert r["count_before_init"] == 1 and r["shutdown_before_init"] == 1  # UNINITIALIZED
    assert r["strings"] == {
        "0": "Success", "1": "Uninitialized", "2": "Invalid Argument", "3": "Not Supported",
        "7": "Insufficient Size", "9": "Driver Not Loaded", "10": "Timeout",
        "13": "Function Not Found", "15": "GPU is lost",
        "18": "RM has detected an NVML/RM version mismatch.",
        "25": "Argument version mismatch", "999": "Unknown Error", "4242": "Unknown Error",
    }
    assert r["init"] == [0, 0]
    assert r["handle"] == [0, 0, True, 2]  # stable handles; bad index: INVALID_ARGUMENT
    assert r["name"] == [0, scn.gpu(0)["name"]]
    assert r["name_exact"] == 0 and r["name_short"] == 7 and r["name_null"] == 2
    assert r["bad_handle"] == 2 and r["driver_short"] == 7
    procs = scn.gpu(0).processes
    assert r["procs"] == [[7, len(procs)], [7, len(procs)],
                          [0, len(procs), [pid for pid, _ in procs]]]
    assert r["fields_zero"] == 0 and r["fields_negative"] == 2
    assert r["mem_v2_bad_version"] == 25 and r["temp_bad_version"] == 25
    assert r["temp_ok"] == [0, scn.gpu(0).as_int("temperature_c")]
    assert r["gpm_support_bad_version"] == 25 and r["gpm_get_bad_version"] == 25
    assert r["gpm_get_no_samples"] == 2
    assert r["ecc_bad_type"] == 2 and r["clock_bad_type"] == 2
    assert r["shutdown"] == [0, 0, 8]  # refcounted: still initialised after one shutdown
    assert r["shutdown_last"] == [0, 1, 1, 1]


# ---------------------------------------------------------------------------
# field values, counters, processes, samples
# ---------------------------------------------------------------------------


def test_field_values_report_per_entry_errors(fake_nvml_lib: Path) -> None:  # noqa: F811
    body = """
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(1)
    out(fields(h, [91, 424242, (138, 17), (138, 18), 1, (139, ALL)]))
    """
    scn = Scenario.load(SCENARIOS / "h100_8x.scn")
    got = run_child(fake_nvml_lib, SCENARIOS / "h100_8x.scn", body)
    assert [f[2] for f in got] == [0, 3, 0, 2, 3, 0]  # the call itself succeeded
    assert got[0][4] == 18
    assert got[5][4] == scn.gpu(1).as_int("nvlink_rx_kib")


def test_counters_grow_at_the_configured_rate(fake_nvml_lib: Path) -> None:  # noqa: F811
    body = """
    t0 = time.monotonic()
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(3)
    ids = [(138, ALL), (139, ALL), 197, 198, 83, (138, 5)]
    a = fields(h, ids)
    time.sleep(1.0)
    b = fields(h, ids)
    out({"a": a, "b": b, "elapsed": time.monotonic() - t0})
    """
    g = Scenario.load(SCENARIOS / "h100_8x_live.scn").gpu(3)
    got = run_child(fake_nvml_lib, SCENARIOS / "h100_8x_live.scn", body)
    keys = ["nvlink_tx_kib", "nvlink_rx_kib", "pcie_tx_bytes", "pcie_rx_bytes", "energy_mj"]
    for k, key in enumerate(keys):
        va, vb = got["a"][k][4], got["b"][k][4]
        dt = (got["b"][k][5] - got["a"][k][5]) / 1e6
        rate = g.as_float(key + "_per_s")  # energy: power_mw, as it is not set
        assert rate > 0
        assert (vb - va) / dt == pytest.approx(rate, rel=0.02), key
        assert g.as_float(key) <= va <= g.counter(key, got["elapsed"]) + 1, key
    # link 5's share grows at 1/18 of the total
    dlink = got["b"][5][4] - got["a"][5][4]
    dt = (got["b"][5][5] - got["a"][5][5]) / 1e6
    assert dlink / dt == pytest.approx(g.as_float("nvlink_tx_kib_per_s") / 18, rel=0.02)


def test_process_list_two_call_pattern(fake_nvml_lib: Path) -> None:  # noqa: F811
    body = """
    N.nvmlInit()
    res = []
    for i in range(N.nvmlDeviceGetCount()):
        h = N.nvmlDeviceGetHandleByIndex(i)
        res.append([[p.pid, p.usedGpuMemory] for p in N.nvmlDeviceGetComputeRunningProcesses(h)])
    out(res)
    """
    # xid79.scn has no processes at all: the first call then returns SUCCESS
    for name in ("h100_8x.scn", "xid79.scn"):
        scn = Scenario.load(SCENARIOS / name)
        got = run_child(fake_nvml_lib, SCENARIOS / name, body)
        assert [[tuple(p) for p in procs] for procs in got] == [
            scn.gpu(i).processes for i in range(scn.gpu_count)]


def test_utilization_samples_are_buffered(fake_nvml_lib: Path) -> None:  # noqa: F811
    body = """
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(2)
    time.sleep(1.1)
    vt, s = N.nvmlDeviceGetSamples(h, N.NVML_GPU_UTILIZATION_SAMPLES, 0)
    gpu = [[x.timeStamp, x.sampleValue.uiVal] for x in s]
    _, s = N.nvmlDeviceGetSamples(h, N.NVML_MEMORY_UTILIZATION_SAMPLES, 0)
    mem = [x.sampleValue.uiVal for x in s]
    last = gpu[-1][0]
    try:
        _, s = N.nvmlDeviceGetSamples(h, N.NVML_GPU_UTILIZATION_SAMPLES, last)
        newer = [x.timeStamp for x in s]
    except N.NVMLError_NotFound:
        newer = []
    out({"vt": vt, "gpu": gpu, "mem": mem, "last": last, "newer": newer,
         "now_us": int(time.time() * 1e6),
         "power_err": err(N.nvmlDeviceGetSamples, h, N.NVML_TOTAL_POWER_SAMPLES, 0)})
    """
    g = Scenario.load(SCENARIOS / "h100_8x_live.scn").gpu(2)
    got = run_child(fake_nvml_lib, SCENARIOS / "h100_8x_live.scn", body)
    assert got["vt"] == 1  # NVML_VALUE_TYPE_UNSIGNED_INT
    assert 5 <= len(got["gpu"]) <= 12
    assert {v for _, v in got["gpu"]} == {g.as_int("util_gpu")}
    assert set(got["mem"]) == {g.as_int("util_memory")}
    stamps = [t for t, _ in got["gpu"]]
    assert all(abs((b - a) - 1e6 / 6) <= 1 for a, b in zip(stamps, stamps[1:], strict=False))
    assert 0 < got["now_us"] - stamps[-1] < 5e6
    assert all(t > got["last"] for t in got["newer"]) and len(got["newer"]) <= 3
    assert got["power_err"] == "NVMLError_NotSupported"


# ---------------------------------------------------------------------------
# events, lost GPUs, hangs, unsupported groups
# ---------------------------------------------------------------------------


def test_xid79_event_and_wait_timeout(fake_nvml_lib: Path) -> None:  # noqa: F811
    body = """
    t0 = time.monotonic()
    N.nvmlInit()
    hs = [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]
    es = N.nvmlEventSetCreate()
    for h in hs:
        N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, es)
    d = N.nvmlEventSetWait_v2(es, 10000)
    ev = {"type": d.eventType, "data": d.eventData, "index": N.nvmlDeviceGetIndex(d.device),
          "gi": d.gpuInstanceId, "at": time.monotonic() - t0}
    t = time.monotonic()
    e = err(N.nvmlEventSetWait_v2, es, 500)
    timeout = {"err": e, "dt": time.monotonic() - t}
    N.nvmlEventSetFree(es)
    out({"ev": ev, "timeout": timeout,
         "unsupported_mask": err(N.nvmlDeviceRegisterEvents, hs[0], 1 << 40,
                                 N.nvmlEventSetCreate())})
    """
    got = run_child(fake_nvml_lib, SCENARIOS / "xid79.scn", body)
    assert Scenario.load(SCENARIOS / "xid79.scn").gpu(1).xids == [(79, 1.0)]
    ev = got["ev"]
    assert (ev["type"], ev["data"], ev["index"]) == (0x8, 79, 1)
    assert ev["gi"] == ALL_LINKS  # 0xFFFFFFFF: no MIG instance
    assert 0.7 <= ev["at"] <= 6
    assert got["timeout"]["err"] == "NVMLError_Timeout"
    assert 0.4 <= got["timeout"]["dt"] <= 5
    assert got["unsupported_mask"] == "NVMLError_NotSupported"


def test_gpu_lost_affects_only_that_gpu(fake_nvml_lib: Path) -> None:  # noqa: F811
    body = """
    t0 = time.monotonic()
    N.nvmlInit()
    hs = [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]
    before = [N.nvmlDeviceGetPowerUsage(h) for h in hs]
    before_at = time.monotonic() - t0
    time.sleep(max(0.0, 2.0 - (time.monotonic() - t0)))
    after = []
    for h in hs:
        try:
            after.append(N.nvmlDeviceGetPowerUsage(h))
        except N.NVMLError_GpuIsLost:
            after.append("lost")
    out({"before": before, "before_at": before_at, "after": after,
         "handle": err(N.nvmlDeviceGetHandleByIndex, 2),
         "fields": err(N.nvmlDeviceGetFieldValues, hs[2], [138]),
         "name": err(N.nvmlDeviceGetName, hs[2]),
         "other_fields": err(N.nvmlDeviceGetFieldValues, hs[3], [138])})
    """
    scn = Scenario.load(SCENARIOS / "gpu_lost.scn")
    assert scn.gpu(2).as_float("lost_after_s") == 1.5
    got = run_child(fake_nvml_lib, SCENARIOS / "gpu_lost.scn", body)
    assert got["before_at"] < 1.5, "child too slow to observe the GPU before it is lost"
    powers = [scn.gpu(i).as_int("power_mw") for i in range(4)]
    assert got["before"] == powers
    assert got["after"] == [powers[0], powers[1], "lost", powers[3]]
    assert got["handle"] == got["fields"] == got["name"] == "NVMLError_GpuIsLost"
    assert got["other_fields"] is None


def test_hang_sleeps_without_holding_the_lock(fake_nvml_lib: Path, tmp_path: Path) -> None:  # noqa: F811
    scn = Scenario.load(SCENARIOS / "hang.scn")
    assert scn.hangs == {"nvmlDeviceGetPowerUsage": 5.0}
    scn.hangs["nvmlDeviceGetPowerUsage"] = 1.0  # keep the test short
    scn.gpu(1).hangs["nvmlDeviceGetTemperature"] = 0.5  # per-GPU hang
    path = scn.dump(tmp_path / "hang.scn")
    body = """
    N.nvmlInit()
    h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
    res = {}
    def slow():
        t = time.monotonic()
        res["power"] = N.nvmlDeviceGetPowerUsage(h0)
        res["power_dt"] = time.monotonic() - t
    th = threading.Thread(target=slow)
    th.start()
    time.sleep(0.1)
    t = time.monotonic()
    temps = [N.nvmlDeviceGetTemperature(h0, 0) for _ in range(50)]
    res["fast_dt"] = time.monotonic() - t
    res["alive_after_fast"] = th.is_alive()
    th.join()
    t = time.monotonic()
    res["temp1"] = N.nvmlDeviceGetTemperature(h1, 0)
    res["temp1_dt"] = time.monotonic() - t
    out(res)
    """
    got = run_child(fake_nvml_lib, path, body)
    assert got["power"] == scn.gpu(0).as_int("power_mw")
    assert 0.9 <= got["power_dt"] <= 6
    assert got["alive_after_fast"], "other calls were blocked by the hanging one"
    assert got["temp1"] == scn.gpu(1).as_int("temperature_c")
    assert 0.45 <= got["temp1_dt"] <= 5


def test_unsupported_groups_on_a_consumer_card(fake_nvml_lib: Path) -> None:  # noqa: F811
    body = """
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    out({
        "name": N.nvmlDeviceGetName(h),
        "arch": N.nvmlDeviceGetArchitecture(h),
        "power": N.nvmlDeviceGetPowerUsage(h),
        "ecc": err(N.nvmlDeviceGetTotalEccErrors, h, 0, 0),
        "mig": err(N.nvmlDeviceGetMigMode, h),
        "gpm_supported": N.nvmlGpmQueryDeviceSupport(h).isSupportedDevice,
        "gpm_sample": err(N.nvmlGpmSampleGet, h, N.nvmlGpmSampleAlloc()),
        "fields": fields(h, [91, (138, ALL), (139, 0), 197, 198, 83]),
        "events": N.nvmlDeviceGetSupportedEventTypes(h),
    })
    """
    g = Scenario.load(SCENARIOS / "pcie_consumer.scn").gpu(0)
    got = run_child(fake_nvml_lib, SCENARIOS / "pcie_consumer.scn", body)
    assert got["name"] == g["name"] == "NVIDIA GeForce RTX 4090"
    assert got["arch"] == 8 and got["power"] == g.as_int("power_mw")
    assert got["ecc"] == got["mig"] == got["gpm_sample"] == "NVMLError_NotSupported"
    assert got["gpm_supported"] == 0
    assert [f[2] for f in got["fields"]] == [3, 3, 3, 0, 0, 0]
    assert got["events"] & 0x8 and not got["events"] & 0x3  # XIDs yes, ECC events no


def test_every_unsupported_group(fake_nvml_lib: Path, tmp_path: Path) -> None:  # noqa: F811
    scn = Scenario()
    scn.gpu(0).unsupported = ["memory", "utilization", "power", "energy", "temperature",
                              "clocks", "clock_reasons", "processes", "events", "samples",
                              "pcie", "gpm"]
    scn.gpu(1)["util_gpu"] = 5  # GPU 1: all defaults, everything supported
    path = scn.dump(tmp_path / "unsup.scn")
    body = """
    N.nvmlInit()
    res = []
    for i in range(2):
        h = N.nvmlDeviceGetHandleByIndex(i)
        res.append({
            "memory": err(N.nvmlDeviceGetMemoryInfo, h),
            "memory_v2": err(N.nvmlDeviceGetMemoryInfo, h, N.nvmlMemory_v2),
            "util": err(N.nvmlDeviceGetUtilizationRates, h),
            "power": err(N.nvmlDeviceGetPowerUsage, h),
            "limit": err(N.nvmlDeviceGetPowerManagementLimit, h),
            "temp": err(N.nvmlDeviceGetTemperature, h, 0),
            "tempV": err(N.nvmlDeviceGetTemperatureV, h, 0),
            "clock": err(N.nvmlDeviceGetClockInfo, h, 1),
            "max_clock": err(N.nvmlDeviceGetMaxClockInfo, h, 1),
            "reasons": err(N.nvmlDeviceGetCurrentClocksEventReasons, h),
            "throttle": err(N.nvmlDeviceGetCurrentClocksThrottleReasons, h),
            "procs": err(N.nvmlDeviceGetComputeRunningProcesses, h),
            "procs_v2": err(N.nvmlDeviceGetComputeRunningProcesses_v2, h),
            "events": err(N.nvmlDeviceGetSupportedEventTypes, h),
            "samples": err(N.nvmlDeviceGetSamples, h, 1, 0) if i == 0 else None,
            "gpm": err(N.nvmlGpmSampleGet, h, N.nvmlGpmSampleAlloc()),
            "fields": [f[2] for f in fields(h, [83, 197, 198, 91])],
            "name": err(N.nvmlDeviceGetName, h),
        })
    out(res)
    """
    unsup, sup = run_child(fake_nvml_lib, path, body)
    fields0, fields1 = unsup.pop("fields"), sup.pop("fields")
    assert unsup.pop("name") is None
    assert unsup == {k: "NVMLError_NotSupported" for k in unsup}
    assert fields0 == [3, 3, 3, 0]  # nvlink itself was not marked unsupported
    assert set(sup.values()) == {None} and fields1 == [0, 0, 0, 0]


# ---------------------------------------------------------------------------
# old driver, driver not loaded, bad scenarios
# ---------------------------------------------------------------------------

OLD_SYMBOLS = {
    "cuda_v2": "N.nvmlSystemGetCudaDriverVersion_v2()",
    "event_reasons": "N.nvmlDeviceGetCurrentClocksEventReasons(h)",
    "supported_event_reasons": "N.nvmlDeviceGetSupportedClocksEventReasons(h)",
    "temperature_v": "N.nvmlDeviceGetTemperatureV(h, 0)",
    "memory_v2": "N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)",
    "processes_v3": "N.nvmlDeviceGetComputeRunningProcesses_v3(h)",
    "gpm_support": "N.nvmlGpmQueryDeviceSupport(h)",
    "gpm_alloc": "N.nvmlGpmSampleAlloc()",
    "gpm_get": "N.nvmlGpmSampleGet(h, None)",
    "gpm_free": "N.nvmlGpmSampleFree(None)",
    "gpm_metrics": "N.nvmlGpmMetricsGet(N.c_nvmlGpmMetricsGet_t())",
}


def test_old_driver_lacks_newer_symbols(
    fake_nvml_lib: Path, fake_nvml_old_lib: Path,  # noqa: F811
) -> None:
    calls = "\n".join(
        f"    res['new'][{k!r}] = err(lambda: {expr})" for k, expr in OLD_SYMBOLS.items())
    body = f"""
N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
m = N.nvmlDeviceGetMemoryInfo(h)
res = {{"new": {{}}, "old": {{
    "driver": N.nvmlSystemGetDriverVersion(),
    "cuda": N.nvmlSystemGetCudaDriverVersion(),
    "throttle": N.nvmlDeviceGetCurrentClocksThrottleReasons(h),
    "supported_throttle": N.nvmlDeviceGetSupportedClocksThrottleReasons(h),
    "temp": N.nvmlDeviceGetTemperature(h, 0),
    "memory": [m.total, m.used],
    "procs": [[p.pid, p.usedGpuMemory] for p in N.nvmlDeviceGetComputeRunningProcesses_v2(h)],
    "name": N.nvmlDeviceGetName(h),
}}}}
if True:
{calls}
out(res)
"""
    g = Scenario.load(SCENARIOS / "old_driver.scn").gpu(0)
    old = run_child(fake_nvml_old_lib, SCENARIOS / "old_driver.scn", body)
    assert old["new"] == {k: "NVMLError_FunctionNotFound" for k in OLD_SYMBOLS}
    o = old["old"]
    assert o["driver"] == "470.182.03" and o["cuda"] == 11040
    assert o["throttle"] == g.as_int("clock_event_reasons") == 1
    assert o["supported_throttle"] == g.as_int("supported_clock_event_reasons")
    assert o["temp"] == g.as_int("temperature_c")
    assert o["memory"] == [g.as_int("memory_total"), g.as_int("memory_used")]
    assert [tuple(p) for p in o["procs"]] == g.processes
    assert o["name"] == "NVIDIA A100-SXM4-80GB"
    # the current build has every one of them (GPM ones fail on an Ampere card,
    # or on the bogus arguments, but they are found)
    new = run_child(fake_nvml_lib, SCENARIOS / "old_driver.scn", body)
    assert "NVMLError_FunctionNotFound" not in new["new"].values()
    assert new["old"] == o


def test_driver_not_loaded_and_init_errors(fake_nvml_lib: Path, tmp_path: Path) -> None:  # noqa: F811
    rm = tmp_path / "rm.scn"
    rm.write_text("init_error LIB_RM_VERSION_MISMATCH\n")
    bad = tmp_path / "bad.scn"
    bad.write_text("gpu 0 util_gpu 50\ngpu 0 no_such_key 1\n")
    body = """
    res = {}
    for name, path in json.loads(os.environ["CASES"]).items():
        if path is None:
            os.environ.pop("FAKE_NVML_SCENARIO", None)
        else:
            os.environ["FAKE_NVML_SCENARIO"] = path
        res[name] = err(N.nvmlInit)
    res["count_after_failed_init"] = err(N.nvmlDeviceGetCount)
    out(res)
    """
    cases = {
        "file": str(SCENARIOS / "driver_not_loaded.scn"),
        "unset": None,
        "missing": str(tmp_path / "no-such.scn"),
        "rm_mismatch": str(rm),
        "parse_error": str(bad),
    }
    got = run_child(fake_nvml_lib, None, body, extra_env={"CASES": json.dumps(cases)})
    assert got["file"] == got["unset"] == got["missing"] == "NVMLError_DriverNotLoaded"
    assert got["rm_mismatch"] == "NVMLError_LibRmVersionMismatch"
    assert got["parse_error"] == "NVMLError_Unknown"
    assert f"{bad}:2: unknown gpu key 'no_such_key'" in got["_stderr"]
    assert got["count_after_failed_init"] == "NVMLError_Uninitialized"


def test_python_defaults_match_the_library(fake_nvml_lib: Path, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "defaults.scn"
    path.write_text("gpu 1 util_gpu 5\n")
    body = """
    N.nvmlInit()
    res = {"driver": N.nvmlSystemGetDriverVersion(), "nvml": N.nvmlSystemGetNVMLVersion(),
           "cuda": N.nvmlSystemGetCudaDriverVersion(), "gpus": []}
    for i in range(N.nvmlDeviceGetCount()):
        h = N.nvmlDeviceGetHandleByIndex(i)
        pci = N.nvmlDeviceGetPciInfo_v3(h)
        m = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
        e1 = fields(h, [83])[0]
        time.sleep(0.3)
        e2 = fields(h, [83])[0]
        res["gpus"].append({
            "name": N.nvmlDeviceGetName(h), "uuid": N.nvmlDeviceGetUUID(h),
            "pci_bus_id": text(pci.busId), "pci_device_id": pci.pciDeviceId,
            "pci_subsystem_id": pci.pciSubSystemId, "architecture": N.nvmlDeviceGetArchitecture(h),
            "memory_total": m.total, "memory_used": m.used, "memory_reserved": m.reserved,
            "util_gpu": N.nvmlDeviceGetUtilizationRates(h).gpu,
            "util_memory": N.nvmlDeviceGetUtilizationRates(h).memory,
            "power_mw": N.nvmlDeviceGetPowerUsage(h),
            "power_limit_mw": N.nvmlDeviceGetPowerManagementLimit(h),
            "temperature_c": N.nvmlDeviceGetTemperature(h, 0),
            "graphics_clock_mhz": N.nvmlDeviceGetClockInfo(h, 0),
            "sm_clock_mhz": N.nvmlDeviceGetClockInfo(h, 1),
            "mem_clock_mhz": N.nvmlDeviceGetClockInfo(h, 2),
            "video_clock_mhz": N.nvmlDeviceGetClockInfo(h, 3),
            "max_graphics_clock_mhz": N.nvmlDeviceGetMaxClockInfo(h, 0),
            "max_sm_clock_mhz": N.nvmlDeviceGetMaxClockInfo(h, 1),
            "max_mem_clock_mhz": N.nvmlDeviceGetMaxClockInfo(h, 2),
            "max_video_clock_mhz": N.nvmlDeviceGetMaxClockInfo(h, 3),
            "clock_event_reasons": N.nvmlDeviceGetCurrentClocksEventReasons(h),
            "supported_clock_event_reasons": N.nvmlDeviceGetSupportedClocksEventReasons(h),
            "ecc_corrected_volatile": N.nvmlDeviceGetTotalEccErrors(h, 0, 0),
            "ecc_corrected_aggregate": N.nvmlDeviceGetTotalEccErrors(h, 0, 1),
            "ecc_uncorrected_volatile": N.nvmlDeviceGetTotalEccErrors(h, 1, 0),
            "ecc_uncorrected_aggregate": N.nvmlDeviceGetTotalEccErrors(h, 1, 1),
            "mig_mode": N.nvmlDeviceGetMigMode(h)[0],
            "mig_pending_mode": N.nvmlDeviceGetMigMode(h)[1],
            "nvlink_links": fields(h, [91])[0][4],
            "nvlink_tx_kib": fields(h, [(138, ALL)])[0][4],
            "pcie_rx_bytes": fields(h, [198])[0][4],
            "energy_rate": (e2[4] - e1[4]) / ((e2[5] - e1[5]) / 1e6),
            "gpm_supported": N.nvmlGpmQueryDeviceSupport(h).isSupportedDevice,
            "procs": len(N.nvmlDeviceGetComputeRunningProcesses(h)),
        })
    out(res)
    """
    scn = Scenario.load(path)
    got = run_child(fake_nvml_lib, path, body)
    assert got["driver"] == scn["driver_version"] and got["nvml"] == scn["nvml_version"]
    assert got["cuda"] == int(scn["cuda_driver_version"])
    assert len(got["gpus"]) == scn.gpu_count == 2
    for i, lib_values in enumerate(got["gpus"]):
        g = scn.gpu(i)
        assert lib_values.pop("energy_rate") == pytest.approx(g.as_float("energy_mj_per_s"),
                                                              rel=0.05)
        assert lib_values.pop("gpm_supported") == 1 and lib_values.pop("procs") == 0
        for key, value in lib_values.items():
            expected = g[key] if isinstance(value, str) else g.as_int(key)
            assert value == expected, (i, key)
        assert set(lib_values) - {"util_gpu"} <= set(gpu_defaults(i)) | {
            "graphics_clock_mhz", "max_graphics_clock_mhz"}


# ---------------------------------------------------------------------------
# scenario rewrites mid-run
# ---------------------------------------------------------------------------

REWRITE_BODY = """
from gpumon.testing.fakenvml import Scenario
path = os.environ["FAKE_NVML_SCENARIO"]
scn = Scenario.load(path)
N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(3)
es = N.nvmlEventSetCreate()
N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, es)
def snap():
    f = fields(h, [(138, ALL), 197])
    return {"power": N.nvmlDeviceGetPowerUsage(h), "util": N.nvmlDeviceGetUtilizationRates(h).gpu,
            "name": N.nvmlDeviceGetName(h), "nvl": f[0][4], "pcie": f[1][4],
            "count": N.nvmlDeviceGetCount()}
res = {"before": snap()}
g = scn.gpu(3)
g["power_mw"] = 123457
g["util_gpu"] = 12
g["name"] = "NVIDIA H100 80GB HBM3 (rewritten)"
g["nvlink_tx_kib_per_s"] = 0          # rate change: the counter keeps its value
g["pcie_tx_bytes"] = 5                # base change: the counter restarts from it
g["pcie_tx_bytes_per_s"] = 0
g.xids.append((48, 0.0))              # already due: fires as soon as it is read
scn.dump(path)
t = time.monotonic()
while time.monotonic() - t < 5 and N.nvmlDeviceGetPowerUsage(h) != 123457:
    time.sleep(0.01)
res["reload_s"] = time.monotonic() - t
res["after"] = snap()
time.sleep(0.2)
res["later"] = snap()
d = N.nvmlEventSetWait_v2(es, 5000)
res["event"] = [d.eventData, N.nvmlDeviceGetIndex(d.device)]
# a broken rewrite keeps the previous scenario
with open(path, "a") as f:
    f.write("gpu 3 bogus_key 1\\n")
time.sleep(0.3)
res["after_broken"] = snap()
out(res)
"""


def test_scenario_rewrite_mid_run(fake_nvml_lib: Path, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "live.scn"
    shutil.copy(SCENARIOS / "h100_8x_live.scn", path)
    g = Scenario.load(path).gpu(3)
    got = run_child(fake_nvml_lib, path, REWRITE_BODY)
    before, after, later = got["before"], got["after"], got["later"]
    assert before["power"] == g.as_int("power_mw") and before["util"] == g.as_int("util_gpu")
    assert got["reload_s"] < 2
    assert after["power"] == 123457 and after["util"] == 12
    assert after["name"] == "NVIDIA H100 80GB HBM3 (rewritten)"
    assert before["nvl"] <= after["nvl"] == later["nvl"]  # continuous, then static
    assert after["pcie"] == later["pcie"] == 5
    assert got["event"] == [48, 3]
    assert got["after_broken"] == later
    assert "keeping the previous scenario" in got["_stderr"]


# ---------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------

THREADS_BODY = """
from gpumon.testing.fakenvml import Scenario
N.nvmlInit()
hs = [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]
es = N.nvmlEventSetCreate()
for h in hs:
    N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, es)
res = {"errors": [], "done": [0, 0, 0, 0]}
def waiter():
    t = time.monotonic()
    try:
        d = N.nvmlEventSetWait_v2(es, 30000)
        res["wait"] = [d.eventData, N.nvmlDeviceGetIndex(d.device)]
    except N.NVMLError as e:
        res["wait"] = type(e).__name__
    res["wait_s"] = time.monotonic() - t
wt = threading.Thread(target=waiter)
wt.start()
time.sleep(0.2)
def worker(k):
    try:
        for n in range(100):
            h = hs[(n + k) % len(hs)]
            N.nvmlDeviceGetPowerUsage(h)
            N.nvmlDeviceGetFieldValues(h, [(138, ALL), 197, 83])
            N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
            N.nvmlDeviceGetComputeRunningProcesses(h)
            s1 = N.nvmlGpmSampleAlloc(); N.nvmlGpmSampleGet(h, s1); N.nvmlGpmSampleFree(s1)
            try:
                N.nvmlEventSetWait_v2(es, 0)  # a second waiter that never blocks
            except N.NVMLError_Timeout:
                pass
            res["done"][k] += 1
    except Exception as e:
        res["errors"].append(repr(e))
t = time.monotonic()
ws = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
for w in ws: w.start()
for w in ws: w.join(60)
res["workers_s"] = time.monotonic() - t
res["waiter_still_blocked"] = wt.is_alive()
scn = Scenario.load(os.environ["FAKE_NVML_SCENARIO"])
scn.gpu(6).xids.append((31, 0.0))
scn.dump(os.environ["FAKE_NVML_SCENARIO"])
wt.join(60)
out(res)
"""


def test_concurrent_calls_while_a_thread_waits_for_events(
    fake_nvml_lib: Path, tmp_path: Path,  # noqa: F811
) -> None:
    path = tmp_path / "threads.scn"
    shutil.copy(SCENARIOS / "h100_8x_live.scn", path)
    started = time.monotonic()
    got = run_child(fake_nvml_lib, path, THREADS_BODY, timeout=90)
    assert got["errors"] == []
    assert got["done"] == [100, 100, 100, 100]
    assert got["waiter_still_blocked"], "the event wait returned early (or workers took 30 s)"
    assert got["wait"] == [31, 6]  # woken by the XID added to the rewritten scenario
    assert got["wait_s"] < 29
    assert time.monotonic() - started < 60
