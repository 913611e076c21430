"""The memory families: breakdown, ZeRO projection and the named component, per rank."""

from __future__ import annotations

from gpumon.analysis.memory import REMEDIES, attribute_growth
from gpumon.analysis.stream import RankAnalysis
from gpumon.export.exposition import render
from gpumon.export.memory_metrics import MemoryFamilies
from gpumon.state.rank_totals import RankTotals
from gpumon.wire import MemoryBreakdown
from tests.helpers import parse_metrics

GIB = 1024**3


def test_breakdown_projection_and_named_component() -> None:
    breakdown = MemoryBreakdown(parameters=4 * GIB, gradients=4 * GIB, optimizer_states=8 * GIB,
                                activations=10 * GIB, other=3 * GIB)
    earlier = MemoryBreakdown(parameters=4 * GIB, gradients=4 * GIB, optimizer_states=8 * GIB,
                              activations=10 * GIB, other=GIB)
    analysis = RankAnalysis("r", 0, memory=attribute_growth([(0.0, earlier), (5.0, breakdown)]))
    state = RankTotals(run="r", rank=0, last_seen_monotonic=0.0, world=4,
                       memory_breakdown=breakdown, analysis=analysis)
    quiet = RankTotals(run="r", rank=1, last_seen_monotonic=0.0, world=4)  # sent no breakdown
    families = MemoryFamilies()
    text = render(list(families.families([state, quiet]))).decode()
    assert text == render(list(families.families([state, quiet]))).decode()
    metrics = parse_metrics(text)

    def value(name: str, **labels: str) -> float | None:
        return metrics.get((name, frozenset(labels.items())))

    rank0 = {"run": "r", "rank": "0"}
    assert value("gpumon_memory_bytes", **rank0, component="optimizer_states") == 8 * GIB
    assert value("gpumon_memory_bytes", **rank0, component="other") == 3 * GIB
    assert value("gpumon_memory_bytes", run="r", rank="1", component="other") is None
    # ZeRO-1 on the run's 4 GPUs: 4 + 4 + 8/4 + 10 + 3; ZeRO-3 on 16: (4 + 4 + 8)/16 + 13.
    assert value("gpumon_memory_zero_projected_bytes", **rank0, stage="1", gpus="4") == 23 * GIB
    assert value("gpumon_memory_zero_projected_bytes", **rank0, stage="3", gpus="16") == 14 * GIB
    assert len([k for k in metrics if k[0] == "gpumon_memory_zero_projected_bytes"]) == 9
    assert value("gpumon_oom_component_bytes", **rank0, component="other", cause="growing",
                 remedy=REMEDIES["other"]) == 2 * GIB


def test_a_new_breakdown_renders_again() -> None:
    families = MemoryFamilies()
    state = RankTotals(run="r", rank=0, last_seen_monotonic=0.0,
                       memory_breakdown=MemoryBreakdown(parameters=1))
    first = render(list(families.families([state])))
    state.memory_breakdown = MemoryBreakdown(parameters=2)
    second = render(list(families.families([state])))
    series = b'gpumon_memory_bytes{component="parameters",rank="0",run="r"} '
    assert series + b"1.0" in first and series + b"2.0" in second
