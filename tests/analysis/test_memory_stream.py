"""The analyzer names the memory component: in the OOM reasons and in the memory-pressure hint;
a leak and growing sequences blame different parts."""

from __future__ import annotations

from dataclasses import replace

from gpumon.analysis.bottleneck import Flag
from gpumon.analysis.memory import REMEDIES
from gpumon.analysis.stream import StepAnalyzer
from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.wire import MemoryBreakdown, MemoryStats, StepRecord

GIB = 1024**3
H100 = GpuStatic(index=0, uuid="GPU-a", name="NVIDIA H100 80GB HBM3", pci_bus_id="",
                 memory_total_bytes=80 * GIB)


def history(index: int, t0: float, t1: float) -> list[GpuSample]:
    return [GpuSample(index=0, t=t0 + k * 0.25, utilization_ratio=0.95, sm_active_ratio=0.93,
                      tensor_active_ratio=0.7) for k in range(int((t1 - t0) / 0.25) + 1)]


def run(kind: str, steps: int = 40, oom_when_read: bool = False) -> StepAnalyzer:
    """One rank whose per-step peak climbs towards 80 GiB, sampled every 5th step; what grows
    is ``kind``: activations (longer sequences) or other (a leak)."""
    analyzer = StepAnalyzer(resolution_s=1.0, oom_when_read=oom_when_read)
    records = []
    for n in range(steps):
        grown = n * 1.5 * GIB
        parts = {"parameters": 4 * GIB, "gradients": 4 * GIB, "optimizer_states": 8 * GIB,
                 "activations": 10 * GIB, "other": 2 * GIB}
        parts["activations" if kind == "seq" else "other"] += int(grown)
        peak = sum(parts.values())
        records.append(StepRecord(
            run="r", rank=0, step=n, duration_s=1.0, t_start=100.0 + n, gpu="GPU-a", world=4,
            phases_s={"forward": 0.4, "backward": 0.5},
            mem=MemoryStats(allocated_bytes=peak, reserved_bytes=peak, peak_bytes=peak),
            memory_breakdown=MemoryBreakdown(**parts) if n % 5 == 0 else None))
    analyzer.add(records, received_t=100.0 + steps)
    analyzer.process(100.0 + steps + 5, history, [H100], {})
    return analyzer


def test_growing_sequences_blame_activations_and_a_leak_blames_other() -> None:
    for kind, component in (("seq", "activations"), ("leak", "other")):
        (analysis,) = run(kind).analyses()
        assert analysis.memory is not None
        assert (analysis.memory.component, analysis.memory.cause) == (component, "growing")
        oom = analysis.oom
        assert oom is not None and oom.risk_ratio >= 0.8
        assert any(component in r and REMEDIES[component] in r for r in oom.reasons), oom.reasons
        verdict = analysis.verdict
        assert verdict is not None and Flag.MEMORY_PRESSURE in verdict.flags
        assert REMEDIES[component] in verdict.hint
        assert "ZeRO/FSDP sharding, activation checkpointing" not in verdict.hint


def test_the_risk_assessed_when_read_is_the_one_assessed_after_every_window() -> None:
    for kind, steps in (("seq", 40), ("leak", 40), ("seq", 3)):
        (eager,) = run(kind, steps).analyses()
        lazy_analyzer = run(kind, steps, oom_when_read=True)
        (lazy,) = lazy_analyzer.analyses()
        assert lazy.oom is not None and lazy.oom == eager.oom
        assert replace(lazy, version=eager.version) == eager
        assert lazy_analyzer.analyses() == [lazy]  # assessed once: read again, the same


def test_without_a_breakdown_the_generic_hint_stays() -> None:
    analyzer = StepAnalyzer(resolution_s=1.0)
    peak = 79 * GIB
    analyzer.add([StepRecord(run="r", rank=0, step=n, duration_s=1.0, t_start=100.0 + n,
                             gpu="GPU-a", phases_s={"forward": 0.4, "backward": 0.5},
                             mem=MemoryStats(peak_bytes=peak, reserved_bytes=peak))
                  for n in range(5)], received_t=105.0)
    analyzer.process(110.0, history, [H100], {})
    (analysis,) = analyzer.analyses()
    assert analysis.memory is None
    assert analysis.verdict is not None
    assert "ZeRO/FSDP sharding, activation checkpointing" in analysis.verdict.hint
