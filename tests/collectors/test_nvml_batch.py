"""Batched reads (requests built once per GPU) against the fake library: per-field answers, a
request read many times, and the same GPM values as the binding's own call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpumon.testing.fakenvml import SCENARIOS, Scenario
from tests.helpers import ROOT, agent_env

_CHILD = """
import json
import pynvml
from gpumon.collectors.nvml.batch import FieldBatch, GpmMetrics
pynvml.nvmlInit()
out = {}
for index in (0, 1):
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    batch = FieldBatch(handle, [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF),
                                (9999, 0), (pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0)])
    out[f"fields{index}"] = [batch.read() for _ in range(3)]
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
ids = [pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, 12345]
metrics = GpmMetrics(ids, first, second)
pynvml.nvmlGpmSampleGet(handle, first)
pynvml.nvmlGpmSampleGet(handle, second)
ours = metrics.read(True)
request = pynvml.c_nvmlGpmMetricsGet_t()
request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
request.numMetrics = len(ids)
request.sample1, request.sample2 = first, second
for i, metric_id in enumerate(ids):
    request.metrics[i].metricId = metric_id
theirs = pynvml.nvmlGpmMetricsGet(request)
out["gpm"] = ours
out["gpm_binding"] = [theirs.metrics[i].value if theirs.metrics[i].nvmlReturn == 0 else None
                      for i in range(len(ids))]
print(json.dumps(out))
"""


def test_field_and_gpm_batches_read_what_the_library_answers(tmp_path: Path,
                                                             fake_nvml_lib: Path) -> None:
    scenario = Scenario.load(SCENARIOS / "h100_8x.scn")
    scenario.gpu(1).unsupported.append("pcie")
    path = scenario.dump(tmp_path / "batch.scn")
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                           timeout=60, cwd=ROOT, env=agent_env(fake_nvml_lib.parent, path))
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout)
    gpu0, gpu1 = scenario.gpu(0), scenario.gpu(1)
    not_supported = 3  # NVML_ERROR_NOT_SUPPORTED
    for reading in out["fields0"]:
        (tx_ret, tx), (odd_ret, _), (rx_ret, rx) = reading
        assert (tx_ret, odd_ret, rx_ret) == (0, not_supported, 0)
        assert tx >= gpu0.as_int("nvlink_tx_kib") and rx >= gpu0.as_int("pcie_rx_bytes")
    # Counters only grow between readings of the same request.
    assert out["fields0"][0][0][1] <= out["fields0"][2][0][1]
    # Each field answers for itself: PCIe not supported on GPU 1, NVLink still read.
    for reading in out["fields1"]:
        assert [ret for ret, _ in reading] == [0, not_supported, not_supported]
        assert reading[0][1] >= gpu1.as_int("nvlink_tx_kib")
    assert out["gpm"][2] is None and out["gpm"][:2] == out["gpm_binding"][:2]
    assert out["gpm"][0] is not None
