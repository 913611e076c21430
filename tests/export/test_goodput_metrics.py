"""The goodput and rank-state families, kept as a block of text per run: the same bytes as
prometheus_client's own families, and a run rendered again as soon as one of its ranks moved."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from gpumon.analysis.goodput import CAUSES, TimeTotals
from gpumon.analysis.stall import RankCondition
from gpumon.export.exposition import render
from gpumon.export.goodput_metrics import GoodputFamilies
from gpumon.export.rank_state_metrics import RankStateFamilies
from tests.export.test_exposition import _Registry


def totals(goodput: float, stalled: float = 0.0, unsaved: float = 1.5) -> TimeTotals:
    badput = {cause: 0.25 * i for i, cause in enumerate(CAUSES)} | {"stalled": stalled}
    return TimeTotals(goodput, badput, unsaved, 1, saves_ok=3, loads_ok=1)


def reference(all_totals: dict[tuple[str, int], TimeTotals], alert_s: float) -> bytes:
    """The families as prometheus_client builds and renders them, series by series."""
    goodput = CounterMetricFamily("gpumon_goodput_seconds", "", labels=["run", "rank"])
    badput = CounterMetricFamily("gpumon_badput_seconds", "", labels=["run", "rank", "cause"])
    unsaved = GaugeMetricFamily("gpumon_unsaved_seconds", "", labels=["run", "rank"])
    restarts = CounterMetricFamily("gpumon_rank_restarts", "", labels=["run", "rank"])
    checkpoints = CounterMetricFamily("gpumon_checkpoints", "",
                                      labels=["run", "rank", "kind", "result"])
    for (run, rank), t in sorted(all_totals.items()):
        labels = [run, str(rank)]
        goodput.add_metric(labels, t.goodput_s)
        for cause in CAUSES:
            badput.add_metric([*labels, cause], t.badput_s[cause])
        unsaved.add_metric(labels, t.unsaved_s)
        restarts.add_metric(labels, float(t.restarts))
        for kind, result, count in (("save", "ok", t.saves_ok), ("save", "failed", t.saves_failed),
                                    ("load", "ok", t.loads_ok), ("load", "failed", t.loads_failed)):
            checkpoints.add_metric([*labels, kind, result], float(count))
    threshold = GaugeMetricFamily("gpumon_unsaved_threshold_seconds", "", value=alert_s)
    metrics: list[Metric] = [goodput, badput, unsaved, restarts, checkpoints, threshold]
    return bytes(generate_latest(_Registry(metrics)))  # type: ignore[no-untyped-call]


def without_help(text: bytes) -> bytes:
    return b"\n".join(line for line in text.split(b"\n") if not line.startswith(b"# HELP"))


def test_goodput_renders_as_prometheus_clients_families_and_follows_every_change() -> None:
    families = GoodputFamilies()
    scrapes = [
        {("b", 1): totals(2.0), ("a", 10): totals(1.0), ("a", 2): totals(3.0)},
        {("b", 1): totals(2.0), ("a", 10): totals(1.0), ("a", 2): totals(3.0)},  # unchanged
        {("b", 1): totals(2.0), ("a", 10): totals(1.0), ("a", 2): totals(3.0, stalled=0.5)},
        {("b", 1): totals(2.5, unsaved=0.0), ("a", 2): totals(3.0, stalled=0.5)},  # a rank gone
        {("b", 1): totals(2.5, unsaved=0.0), ("c", 0): totals(0.0)},  # a run gone, one new
    ]
    for all_totals in scrapes:
        ours = render(families.families(all_totals, 3600.0))
        assert without_help(ours) == without_help(reference(all_totals, 3600.0))


def condition(rank: int, state: str, stalled_s: float | None = None) -> RankCondition:
    placed = {"phase": "backward", "op": "all_reduce", "location": "train.py:12 step",
              "waits_on": (1,)} if state == "stalled" else {}
    return RankCondition(rank, state, stalled_s=stalled_s, **placed)  # type: ignore[arg-type]


def test_rank_states_follow_a_stall_and_its_clock_from_one_scrape_to_the_next() -> None:
    families = RankStateFamilies()

    def scrape(conditions: dict[tuple[str, int], RankCondition]) -> str:
        return render(families.families(conditions)).decode()

    stepping = {("r", 0): condition(0, "stepping"), ("r", 1): condition(1, "stepping")}
    first = scrape(stepping)
    assert scrape(dict(stepping)) == first
    assert 'gpumon_rank_state{rank="0",run="r",state="stepping"} 1.0' in first
    stalled = {**stepping, ("r", 0): condition(0, "stalled", 2.0)}
    text = scrape(stalled)
    assert 'gpumon_rank_state{rank="0",run="r",state="stalled"} 1.0' in text
    assert 'gpumon_rank_stalled_seconds{rank="0",run="r"} 2.0' in text
    assert 'op="all_reduce"' in text
    later = scrape({**stepping, ("r", 0): condition(0, "stalled", 7.0)})
    assert 'gpumon_rank_stalled_seconds{rank="0",run="r"} 7.0' in later
    assert scrape(stepping) == first
