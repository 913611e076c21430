"""The agent's views from plain state: readiness and the JSON snapshot."""

from __future__ import annotations

from gpumon.agent.views import readiness, snapshot_document
from gpumon.collectors.samples import GpuSample, GpuStatic, SenderCredentials
from gpumon.state.node import NodeState, NvmlStatus
from gpumon.state.ranks import RankStore
from gpumon.wire import StepRecord

GPU = GpuStatic(index=0, uuid="GPU-a", name="NVIDIA H100 80GB HBM3", pci_bus_id="0000:01:00.0")


def test_starting_until_a_cycle_succeeds_then_ok() -> None:
    node = NodeState()
    node.set_nvml(NvmlStatus(up=True), [GPU])
    stats = node.collector("nvml", 1.0)
    assert readiness(node.snapshot(0.0), None, 100.0) == (
        False, {"status": "starting", "problems": []})
    stats.last_success_t = 1.0
    assert readiness(node.snapshot(1.0), None, 100.0) == (True, {"status": "ok", "problems": []})


def test_degraded_names_a_stuck_cycle_a_lost_gpu_and_ingest() -> None:
    node = NodeState()
    node.set_nvml(NvmlStatus(up=False, message="no driver"), [GPU])
    host = node.collector("host", 5.0)
    host.last_success_t = 1.0
    node.collector("nvml", 1.0).running_since_monotonic = 90.0  # 10 s into a 1 s cycle
    node.put_gpu_samples([GpuSample(index=0, t=1.0, up=False)])
    ready, body = readiness(node.snapshot(2.0), "socket directory missing", 100.0)
    assert ready
    assert body == {"status": "degraded", "problems": [
        "nvml: no driver", "nvml: cycle stuck for 10s", "ingest: socket directory missing",
        "gpu lost: 0"]}
    node.collector("nvml", 1.0).running_since_monotonic = 96.0  # within 3 intervals + 2 s
    assert "nvml: cycle stuck for 4s" not in readiness(node.snapshot(2.0), None, 100.0)[1][
        "problems"]


def test_snapshot_lists_gpus_and_ranks_without_analysis_yet() -> None:
    node = NodeState()
    node.set_nvml(NvmlStatus(up=True, driver_version="550.54"), [GPU])
    node.put_gpu_samples([GpuSample(index=0, t=5.0, utilization_ratio=0.5,
                                    process_memory_bytes={42: 10})])
    store = RankStore()
    store.ingest([StepRecord(run="r", rank=1, step=3, duration_s=0.5)], SenderCredentials(pid=42),
                 monotonic=0.0, now_t=6.0)
    doc = snapshot_document(node.snapshot(6.0), store.ranks())
    assert doc["nvml"]["driver_version"] == "550.54"
    assert doc["gpus"][0]["utilization_ratio"] == 0.5
    assert doc["gpus"][0]["process_memory_bytes"] == {"42": 10}  # JSON keys are strings
    assert "memory_used_bytes" not in doc["gpus"][0]  # absent stays absent
    (rank,) = doc["ranks"]
    assert (rank["run"], rank["rank"], rank["pid"], rank["last_step"]) == ("r", 1, 42, 3)
    assert rank["analysis"] is None
