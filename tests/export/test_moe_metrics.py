"""The expert-load families: one series per (run, rank, layer), from each rank's latest
summary, through the rank store as ingest fills it."""

from __future__ import annotations

import json

from gpumon.export.exposition import render
from gpumon.export.moe_metrics import MoeFamilies
from gpumon.state.rank_totals import RankTotals
from gpumon.wire import ExpertLoad, MoeStats, decode_datagram
from tests.helpers import parse_metrics


def _metrics(families: MoeFamilies, ranks: list[RankTotals]) -> dict:
    return parse_metrics(render(list(families.families(ranks))).decode())


def _step(step: int, layers: dict[str, list[object]]) -> RankTotals:
    return decode_datagram(json.dumps({"v": 1, "kind": "step", "run": "r", "rank": 1, "step": step,
                                       "duration": 0.2, "moe": {"window": step, "layers": layers}}
                                      ).encode()).records[0]


def test_each_layer_of_each_rank_is_a_series_and_the_latest_summary_wins() -> None:
    state = RankTotals(run="r", rank=1, last_seen_monotonic=0.0)
    state.add_step(_step(1, {"0": [8, 80, 3.0, 1.1, 2], "1": [8, 80, 1.0, 0.0, 0]}), 0.0)
    state.add_step(_step(2, {"0": [8, 160, 2.5, 0.9, 1], "1": [8, 160, 1.2, 0.1, 0]}), 0.0)
    quiet = RankTotals(run="r", rank=0, last_seen_monotonic=0.0)  # no MoE layer
    families = MoeFamilies()
    metrics = _metrics(families, [state, quiet])

    def value(name: str, **labels: str) -> float | None:
        return metrics.get((name, frozenset(labels.items())))

    layer0 = {"run": "r", "rank": "1", "layer": "0"}
    assert value("gpumon_moe_expert_load_max_ratio", **layer0) == 2.5
    assert value("gpumon_moe_expert_load_cv", **layer0) == 0.9
    assert value("gpumon_moe_dead_experts", **layer0) == 1
    assert value("gpumon_moe_experts", **layer0) == 8
    assert value("gpumon_moe_expert_load_max_ratio", run="r", rank="1", layer="1") == 1.2
    assert value("gpumon_moe_window_steps", run="r", rank="1") == 2
    assert not [key for key in metrics if dict(key[1]).get("rank") == "0"]
    # Never a series per expert: five families, two layers.
    assert len(metrics) == 4 * 2 + 1


def test_a_changed_summary_is_rendered_again() -> None:
    families = MoeFamilies()
    first = RankTotals(run="r", rank=0, last_seen_monotonic=0.0,
                       moe=MoeStats(5, (ExpertLoad("0", 4, 40, 2.0, 0.5, 0),)))
    assert _metrics(families, [first])[("gpumon_moe_expert_load_max_ratio",
                                        frozenset({"run": "r", "rank": "0", "layer": "0"}.items()))] == 2.0
    second = RankTotals(run="r", rank=0, last_seen_monotonic=0.0,
                        moe=MoeStats(6, (ExpertLoad("0", 4, 48, 1.5, 0.4, 0),)))
    assert _metrics(families, [second])[("gpumon_moe_expert_load_max_ratio",
                                         frozenset({"run": "r", "rank": "0", "layer": "0"}.items()))] == 1.5
