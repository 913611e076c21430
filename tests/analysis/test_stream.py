"""The streaming verdict engine: windows, grouping, clock skew, attribution."""

from __future__ import annotations

from gpumon.analysis.stream import StepAnalyzer, attribute_gpu
from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.protocol import StepRecord

H100 = GpuStatic(index=0, uuid="GPU-a", name="NVIDIA H100 80GB HBM3", pci_bus_id="",
                 memory_total_bytes=80 * 1024**3)


def busy_samples(t0: float, t1: float) -> list[GpuSample]:
    return [GpuSample(index=0, t=t0 + k * 0.25, utilization_ratio=0.95, sm_active_ratio=0.93,
                      tensor_active_ratio=0.7, dram_active_ratio=0.3)
            for k in range(int((t1 - t0) / 0.25) + 1)]


def history(index: int, t0: float, t1: float) -> list[GpuSample]:
    return [s for s in busy_samples(0.0, 100.0) if t0 <= s.t <= t1]


def step(n: int, t0: float, duration: float = 0.1, **extra: object) -> StepRecord:
    return StepRecord(run="r", rank=0, step=n, duration_s=duration, t_start=t0, gpu="GPU-a",
                      phases_s={"forward": duration * 0.4, "backward": duration * 0.5},
                      **extra)  # type: ignore[arg-type]


def test_short_steps_are_merged_until_they_span_the_resolution() -> None:
    analyzer = StepAnalyzer(resolution_s=1.0)
    analyzer.add([step(n, 10.0 + n * 0.1) for n in range(30)], received_t=13.0)
    verdicts = analyzer.process(20.0, history, [H100], {})
    assert [len(v.steps) for v in verdicts] == [10, 10, 10]
    assert sum(len(v.steps) for v in verdicts) == 30
    assert all(v.verdict.primary.value == "compute" for v in verdicts)


def test_steps_wait_for_their_gpu_samples() -> None:
    analyzer = StepAnalyzer(resolution_s=1.0)
    analyzer.add([step(n, 10.0 + n * 0.5, duration=0.5) for n in range(4)], received_t=12.0)
    assert analyzer.process(12.0, history, [H100], {}) == []  # too fresh: samples may lag
    assert sum(len(v.steps) for v in analyzer.process(14.0, history, [H100], {})) == 4


def test_a_client_clock_far_ahead_is_rebased_on_receipt() -> None:
    analyzer = StepAnalyzer(resolution_s=1.0)
    analyzer.add([step(0, 10_000.0, duration=1.0)], received_t=50.0)  # "ends" 10,000 s later
    verdicts = analyzer.process(52.0, history, [H100], {})
    assert [v.steps for v in verdicts] == [(0,)]


def test_gpu_attribution_prefers_uuid_then_process_list_then_index() -> None:
    other = GpuStatic(index=1, uuid="GPU-b", name="x", pci_bus_id="")
    latest = {1: GpuSample(index=1, t=0.0, process_memory_bytes={4242: 1})}
    assert attribute_gpu("GPU-b", None, [H100, other], {}) == 1
    assert attribute_gpu(None, 4242, [H100, other], latest) == 1
    assert attribute_gpu(0, None, [H100, other], {}) == 0
    assert attribute_gpu(7, None, [H100, other], {}) is None
    assert attribute_gpu("GPU-zzz", None, [H100, other], {}) is None
