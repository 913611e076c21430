"""The node state's GPU history: what it keeps of each sample for per-step windows."""

from __future__ import annotations

from gpumon.analysis.window import summarize_gpu_window
from gpumon.collectors.samples import GpuSample
from gpumon.state.node import GPU_HISTORY, NodeState

T = 1_700_000_000.0


def sample(k: int, throttled: bool = False) -> GpuSample:
    return GpuSample(
        index=0, t=T + k, utilization_ratio=0.5 + k % 5 / 10, memory_utilization_ratio=0.4,
        memory_used_bytes=60_000_000_000 + k, memory_total_bytes=85_000_000_000,
        pcie_tx_bytes_total=10 * k, pcie_rx_bytes_total=20 * k, nvlink_tx_bytes_total=30 * k,
        nvlink_rx_bytes_total=40 * k, sm_active_ratio=0.8, sm_occupancy_ratio=0.5,
        tensor_active_ratio=0.6, dram_active_ratio=0.45, power_watts=500.0 + k,
        temperature_celsius=61.0, sm_clock_hz=1.98e9,
        clock_event_reasons={"gpu_idle": False, "sw_power_cap": throttled},
        ecc_errors_total={"corrected": k, "uncorrected": 0},
        process_memory_bytes={4242: 1 << 30}, nvlink_tx_bytes_per_second=1e8 + k,
        nvlink_rx_bytes_per_second=2e8, pcie_tx_bytes_per_second=3e8, pcie_rx_bytes_per_second=4e8)


def test_windows_over_the_kept_history_are_those_of_the_whole_samples() -> None:
    state = NodeState()
    samples = [sample(k, throttled=10 <= k < 14) for k in range(40)]
    for s in samples:
        state.put_gpu_samples([s])
    kept = state.gpu_history()[0]
    assert len(kept) == 40
    for t0, t1 in ((T, T + 39), (T + 8, T + 15), (T + 12.5, T + 12.7), (T + 20, T + 30)):
        assert summarize_gpu_window(kept, t0, t1) == summarize_gpu_window(samples, t0, t1)
    # What the history dropped, and what it shares between samples alike.
    assert kept[-1].ecc_errors_total is None and kept[-1].process_memory_bytes is None
    assert kept[30].clock_event_reasons is kept[31].clock_event_reasons
    assert kept[12].clock_event_reasons == {"gpu_idle": False, "sw_power_cap": True}
    assert kept[9].clock_event_reasons is not kept[10].clock_event_reasons


def test_the_latest_sample_is_whole_and_the_history_bounded() -> None:
    state = NodeState()
    for k in range(GPU_HISTORY + 5):
        state.put_gpu_samples([sample(k)])
    assert state.snapshot(T).latest[0] == sample(GPU_HISTORY + 4)
    kept = state.gpu_history()[0]
    assert len(kept) == GPU_HISTORY and kept[0].t == T + 5
