"""On an old driver, each newer NVML entry point the library lacks is learnt once and said once.

A child process loads the old-driver fake library (which lacks the newer symbols) for eight
GPUs and polls them a hundred times with NvmlSource, its clock advancing a second a poll (so
the slow set, with the process list, is read ten times); its INFO log is counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpumon.testing.fakenvml import SCENARIOS
from tests.helpers import ROOT, agent_env

POLLS = 100
NEWER_SYMBOLS = {"nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetTemperatureV",
                 "nvmlDeviceGetCurrentClocksEventReasons",
                 "nvmlDeviceGetComputeRunningProcesses_v3"}

_CHILD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from gpumon.collectors.nvml import NvmlSource
from gpumon.collectors.nvml.versions import missing_symbols
errors = []
source = NvmlSource(lambda collector, error: errors.append(error))
polled = []
for k in range(int(sys.argv[1])):
    samples = source.sample(1e9 + k, 1000.0 + k)
    polled.append(sum(1 for s in samples if s.up and s.temperature_celsius is not None
                      and s.memory_used_bytes is not None
                      and s.clock_event_reasons is not None))
source.close()
print(json.dumps({"polled": polled, "missing": sorted(missing_symbols()), "errors": errors,
                  "processes": [s.process_memory_bytes is not None for s in samples]}))
"""


def test_a_missing_symbol_is_learnt_once_and_logged_once_by_name(
        tmp_path: Path, fake_nvml_old_lib: Path) -> None:
    scenario = tmp_path / "old_driver_8x.scn"
    scenario.write_text((SCENARIOS / "old_driver.scn").read_text() + "gpu_count 8\n")
    child = subprocess.run([sys.executable, "-c", _CHILD, str(POLLS)], capture_output=True,
                           text=True, timeout=120, cwd=ROOT,
                           env=agent_env(fake_nvml_old_lib.parent, scenario))
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout.strip().splitlines()[-1])
    # Every poll of every GPU still reads the older calls' values.
    assert result["polled"] == [8] * POLLS
    assert result["errors"] == []
    assert set(result["missing"]) == NEWER_SYMBOLS
    lines = [line for line in child.stderr.splitlines() if "missing in this NVML driver" in line]
    # 800 GPU polls, one line per symbol, each naming it (no "<lambda>").
    assert sorted(line.split()[1] for line in lines) == sorted(NEWER_SYMBOLS), lines
    assert not any("lambda" in line for line in child.stderr.splitlines())
