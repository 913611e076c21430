"""The node state's GPU history: what it keeps of each sample for per-step windows."""

from __future__ import annotations

from gpumon.analysis.window import summarize_gpu_window
from gpumon.collectors.samples import GpuSample
from gpumon.state.gpu_history import window
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
        inside = window(kept, 0, t0, t1)
        assert [s.t for s in inside] == [s.t for s in samples if t0 <= s.t <= t1]
        assert summarize_gpu_window(inside, t0, t1) == summarize_gpu_window(samples, t0, t1)
    # What the history dropped, and what it shares between samples alike.
    whole = window(kept, 0, T, T + 39)
    assert whole[-1].ecc_errors_total is None and whole[-1].process_memory_bytes is None
    assert whole[30].memory_used_bytes == 60_000_000_030
    assert isinstance(whole[30].memory_used_bytes, int)
    assert whole[30].clock_event_reasons is whole[31].clock_event_reasons
    assert whole[12].clock_event_reasons == {"gpu_idle": False, "sw_power_cap": True}
    assert whole[9].clock_event_reasons is not whole[10].clock_event_reasons


def test_a_down_gpu_and_missing_fields_come_back_as_they_were() -> None:
    state = NodeState()
    down = GpuSample(index=3, t=T, up=False, error="GPU_IS_LOST")
    partial = GpuSample(index=3, t=T + 1, utilization_ratio=float("nan"), power_watts=0.0,
                        memory_total_bytes=80 << 30)
    state.put_gpu_samples([down])
    state.put_gpu_samples([partial])
    back = window(state.gpu_history()[3], 3, T, T + 1)
    assert back[0] == GpuSample(index=3, t=T, up=False)
    assert back[1].power_watts == 0.0 and back[1].memory_total_bytes == 80 << 30
    assert back[1].utilization_ratio != back[1].utilization_ratio  # NaN stays NaN
    assert back[1].sm_active_ratio is None and back[1].memory_used_bytes is None


def test_the_latest_sample_is_whole_and_the_history_bounded() -> None:
    state = NodeState()
    for k in range(GPU_HISTORY + 5):
        state.put_gpu_samples([sample(k)])
    assert state.snapshot(T).latest[0] == sample(GPU_HISTORY + 4)
    kept = state.gpu_history()[0]
    assert len(kept) == GPU_HISTORY
    assert window(kept, 0, T, T + 6)[0].t == T + 5
