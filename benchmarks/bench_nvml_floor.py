"""A collection cycle split: the NVML entry points alone (the floor), gpumon's Python around
them, and what a cycle leaves allocated; on the fake NVML's 8×H100 node.

Run from the repository root (builds the fake library with gcc)::

    .venv/bin/python benchmarks/bench_nvml_floor.py [--cycles 500] [--rounds 7]

In one child process that loads the fake libnvidia-ml.so.1 through the nvidia-ml-py binding,
its clock advanced one 1 s interval per cycle (as bench_agent.py: a GPM pair every cycle, the
slow set every tenth), rounds alternating:

- ``source``: ``NvmlSource.sample()``, the agent's cycle (its per-GPU worker threads
  included: CPU of the whole process);
- ``devices``: each GPU's ``NvmlDevice.sample()`` called in turn on one thread (the same
  work without the workers' hand-offs);
- ``floor``: the entry points a cycle calls (memory, utilization, power, temperature, SM
  clock, clock events, the field-value request of the table's fields and the byte
  counters, a GPM sample and the GPM metrics), each GPU's, through ctypes with every
  argument built once: the cost of the NVML calls alone, which no
  collector on this library can go below.

CPU per 8-GPU cycle is the median of the rounds (process_time); the allocation is the net
growth of traced memory over a round of ``source`` cycles.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, SCENARIO

from gpumon.testing import agent_env
from gpumon.testing.fakenvml import build_fake_nvml

_CHILD = """
import ctypes, json, statistics, sys, time, tracemalloc
import pynvml
from gpumon.collectors import nvml

cycles, rounds = int(sys.argv[1]), int(sys.argv[2])
source = nvml.NvmlSource(lambda group, error: None)
devices = source.devices
handles = [d._handle for d in devices]
base = time.monotonic() + 1000.0
clock = [0]

def source_cycle():
    clock[0] += 1
    source.sample(time.time(), base + clock[0])

def devices_cycle():
    clock[0] += 1
    for d in devices:
        d.sample(time.time(), base + clock[0])

fn = {name: pynvml._nvmlGetFunctionPointer(name) for name in (
    "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetCurrentClocksEventReasons")}
memory = pynvml.c_nvmlMemory_v2_t()
memory.version = pynvml.nvmlMemory_v2
util, uint, ulong = pynvml.c_nvmlUtilization_t(), ctypes.c_uint(), ctypes.c_ulonglong()
batches = [d._fields.request.batch for d in devices if d._fields.request is not None]
gpm = [d._gpm_metrics for d in devices if d._gpm_metrics is not None]
calls = [(fn["nvmlDeviceGetMemoryInfo_v2"], (h, ctypes.byref(memory))) for h in handles]
calls += [(fn["nvmlDeviceGetUtilizationRates"], (h, ctypes.byref(util))) for h in handles]
calls += [(fn["nvmlDeviceGetPowerUsage"], (h, ctypes.byref(uint))) for h in handles]
calls += [(fn["nvmlDeviceGetTemperature"], (h, 0, ctypes.byref(uint))) for h in handles]
calls += [(fn["nvmlDeviceGetClockInfo"], (h, 1, ctypes.byref(uint))) for h in handles]
calls += [(fn["nvmlDeviceGetCurrentClocksEventReasons"], (h, ctypes.byref(ulong)))
          for h in handles]
calls += [(b._fn, (b._handle, ctypes.c_int32(len(b._entries)), b._entries)) for b in batches]
sample_get = pynvml._nvmlGetFunctionPointer("nvmlGpmSampleGet")
calls += [(sample_get, (d._handle, d._gpm_samples[0])) for d in devices if d._gpm_samples]
calls += [(g._fn, (ctypes.byref(g._requests[0]),)) for g in gpm]

def floor_cycle():
    for call, args in calls:
        call(*args)

kinds = {"source": source_cycle, "devices": devices_cycle, "floor": floor_cycle}
for run in kinds.values():
    for _ in range(20):
        run()
cpu = {name: [] for name in kinds}
for _ in range(rounds):
    for name, run in kinds.items():
        start = time.process_time()
        for _ in range(cycles):
            run()
        cpu[name].append((time.process_time() - start) / cycles)
tracemalloc.start()
before = tracemalloc.get_traced_memory()[0]
for _ in range(cycles):
    source_cycle()
grown = tracemalloc.get_traced_memory()[0] - before
tracemalloc.stop()
source.close()
out = {f"{name}_cpu_s_per_cycle": statistics.median(v) for name, v in cpu.items()}
out.update(gpus=len(devices), nvml_calls_per_cycle=len(calls),
           allocated_bytes_per_cycle=grown / cycles)
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as build_dir:
        lib = build_fake_nvml(Path(build_dir))
        out = subprocess.run([sys.executable, "-c", _CHILD, str(args.cycles), str(args.rounds)],
                             env=agent_env(lib.parent, SCENARIO), cwd=ROOT, capture_output=True,
                             text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    floor = r["floor_cpu_s_per_cycle"]
    rows = [
        ("NvmlSource.sample(), 8 GPUs (the agent's cycle)", r["source_cpu_s_per_cycle"]),
        ("each NvmlDevice.sample() on one thread", r["devices_cpu_s_per_cycle"]),
        (f"floor: the {r['nvml_calls_per_cycle']} NVML calls alone", floor),
    ]
    for name, seconds in rows:
        print(f"{name:<52} {seconds * 1e6:7.0f} µs  {seconds / floor:5.1f}× the floor")
    print(f"{'allocated and kept per cycle':<52} {r['allocated_bytes_per_cycle']:7.0f} B")
    print(json.dumps({"benchmark": "nvml_floor", **r}))


if __name__ == "__main__":
    main()
