"""The time ledger: every second of a rank's processes counted once, counters never going down."""

from __future__ import annotations

import pytest

from gpumon.analysis.goodput import CAUSES, MAX_UNSAVED_ENTRIES, TimeLedger


def run_steps(ledger: TimeLedger, first: int, count: int, t: float, seconds: float = 1.0) -> float:
    for _ in range(count):
        t += seconds
        ledger.step(seconds, t)
    return t


def test_startup_steps_and_a_save_keep_the_work() -> None:
    ledger = TimeLedger()
    ledger.process(10, start=100.0, now=103.0)
    t = run_steps(ledger, 1, 5, 105.0)  # first step began at 105: 5 s of startup
    totals = ledger.totals(t)
    assert totals.badput_s["startup"] == pytest.approx(5.0)
    assert totals.unsaved_s == pytest.approx(5.0) and totals.goodput_s == 0.0
    assert ledger.span("save", 2.0, True, None, t + 2.0) == 5
    t = run_steps(ledger, 6, 3, t + 2.0)
    totals = ledger.totals(t)
    assert totals.goodput_s == pytest.approx(5.0)
    assert totals.unsaved_s == pytest.approx(3.0)
    assert totals.badput_s["checkpoint"] == pytest.approx(2.0)
    assert totals.wall_s == pytest.approx(t - 100.0)
    assert totals.saves_ok == 1


def test_a_failure_loses_the_unsaved_work_and_the_gap_is_restart() -> None:
    ledger = TimeLedger()
    ledger.process(10, 0.0, 0.0)
    t = run_steps(ledger, 1, 4, 1.0)
    ledger.span("save", 1.0, True, None, t + 1.0)
    t = run_steps(ledger, 5, 3, t + 1.0)  # three steps after the checkpoint...
    ledger.ended(t + 0.5)  # ...then the process dies
    mid = ledger.totals(t + 0.5)
    assert mid.badput_s["lost"] == pytest.approx(3.0) and mid.unsaved_s == 0.0
    ledger.process(11, t + 3.5, t + 4.0)  # torchrun starts its successor 3 s later
    t = run_steps(ledger, 5, 3, t + 5.5)  # restored in 2 s: startup
    ledger.finished(t)
    totals = ledger.totals(t)
    assert totals.restarts == 1
    assert totals.badput_s["restart"] == pytest.approx(3.0)
    assert totals.badput_s["startup"] == pytest.approx(1.0 + 2.0)
    assert totals.goodput_s == pytest.approx(4.0 + 3.0)
    assert totals.wall_s == pytest.approx(t)
    assert mid.badput_s["lost"] <= totals.badput_s["lost"]


def test_a_clean_finish_keeps_everything_and_a_later_process_is_no_restart() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    t = run_steps(ledger, 1, 3, 0.0)
    ledger.finished(t)
    ledger.ended(t + 0.1)
    ledger.process(2, t + 50.0, t + 50.0)
    totals = ledger.totals(t + 50.0)
    assert totals.goodput_s == pytest.approx(3.0) and totals.restarts == 0
    assert totals.badput_s["lost"] == 0.0 and totals.badput_s["restart"] == 0.0


def test_a_job_that_never_saves_has_all_its_work_at_risk() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    t = run_steps(ledger, 1, 10, 0.0)
    assert ledger.totals(t).unsaved_s == pytest.approx(10.0)
    assert ledger.totals(t).goodput_s == 0.0


def test_a_failed_save_preserves_nothing() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    t = run_steps(ledger, 1, 4, 0.0)
    assert ledger.span("save", 1.0, False, None, t + 1.0) is None
    totals = ledger.totals(t + 1.0)
    assert totals.unsaved_s == pytest.approx(4.0) and totals.saves_failed == 1
    assert totals.badput_s["checkpoint"] == pytest.approx(1.0)


def test_an_async_save_keeps_only_the_steps_before_it_once_it_completes() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    t = run_steps(ledger, 1, 4, 0.0)
    ledger.span("save", 0.2, None, 4, t + 0.2)  # blocks 0.2 s, goes on writing
    t = run_steps(ledger, 5, 2, t + 0.2)
    assert ledger.totals(t).goodput_s == 0.0
    assert ledger.span("saved", 3.0, True, 4, t) == 4
    totals = ledger.totals(t)
    assert totals.goodput_s == pytest.approx(4.0) and totals.unsaved_s == pytest.approx(2.0)
    assert totals.badput_s["checkpoint"] == pytest.approx(0.2)


def test_another_ranks_save_keeps_as_many_steps_as_it_covers() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    t = run_steps(ledger, 1, 6, 0.0)
    ledger.preserve(4)
    assert ledger.totals(t).goodput_s == pytest.approx(4.0)
    ledger.preserve(8)  # covers two steps that have not arrived yet: kept as they come
    t = run_steps(ledger, 7, 3, t)
    totals = ledger.totals(t)
    assert totals.goodput_s == pytest.approx(8.0) and totals.unsaved_s == pytest.approx(1.0)


def test_a_save_covers_the_steps_done_when_it_began_even_those_still_on_their_way() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    t = run_steps(ledger, 1, 3, 0.0)
    assert ledger.span("save", 1.0, True, 5, t + 1.0) == 5  # steps 4 and 5 are still queued
    t = run_steps(ledger, 4, 3, t + 1.0)
    totals = ledger.totals(t)
    assert totals.goodput_s == pytest.approx(5.0) and totals.unsaved_s == pytest.approx(1.0)


def test_a_stall_is_stalled_not_step_time_and_counts_while_open() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    t = run_steps(ledger, 1, 3, 0.0)
    ledger.outside("stalled", t, t + 20.0)
    assert ledger.totals(t + 30.0).badput_s["stalled"] == pytest.approx(30.0)
    ledger.step(31.0, t + 31.0)  # the hung step ends
    totals = ledger.totals(t + 31.0)
    assert totals.badput_s["stalled"] == pytest.approx(31.0)
    assert totals.unsaved_s == pytest.approx(3.0)
    assert totals.wall_s == pytest.approx(t + 31.0)


def test_evaluation_spans_after_the_first_step_and_a_restore_before_it() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    ledger.span("load", 2.0, True, None, 3.0)  # the restore: part of the startup
    t = run_steps(ledger, 1, 2, 4.0)
    ledger.span("eval", 5.0, True, None, t + 5.0)
    t = run_steps(ledger, 3, 2, t + 5.0)
    totals = ledger.totals(t)
    assert totals.badput_s["startup"] == pytest.approx(4.0)
    assert totals.badput_s["checkpoint"] == 0.0 and totals.loads_ok == 1
    assert totals.badput_s["evaluation"] == pytest.approx(5.0)
    assert totals.wall_s == pytest.approx(t)


def test_the_figures_never_go_down() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    seen = ledger.totals(0.0)
    t = 0.0
    for n in range(1, 40):
        t += 1.3
        ledger.step(1.0, t)  # 0.3 s between steps: other
        if n % 7 == 0:
            ledger.span("save", 0.5, True, None, t + 0.5)
            t += 0.5
        if n == 30:
            ledger.ended(t)
            ledger.process(2, t + 1.0, t + 1.0)
            t += 1.0
        now = ledger.totals(t)
        assert now.goodput_s >= seen.goodput_s
        assert all(now.badput_s[c] >= seen.badput_s[c] - 1e-9 for c in CAUSES)
        seen = now
    assert seen.wall_s == pytest.approx(t, rel=0.05)


def test_unsaved_steps_are_bounded_and_kept_no_earlier_than_due() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    run_steps(ledger, 1, MAX_UNSAVED_ENTRIES + 100, 0.0, seconds=0.01)
    assert len(ledger._unsaved) == MAX_UNSAVED_ENTRIES
    ledger.preserve(50)
    totals = ledger.totals(1e6)
    assert totals.goodput_s <= 50 * 0.01 + 1e-9
    assert totals.goodput_s + totals.unsaved_s == pytest.approx((MAX_UNSAVED_ENTRIES + 100) * 0.01)


def test_a_step_that_arrives_after_the_failure_is_lost_with_the_rest() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    t = run_steps(ledger, 1, 3, 0.0)
    ledger.ended(t + 0.1)
    ledger.step(1.0, t + 0.2)  # its last datagram, read after the exit
    totals = ledger.totals(t + 0.2)
    assert totals.badput_s["lost"] == pytest.approx(4.0) and totals.unsaved_s == 0.0


def test_the_reads_of_one_restore_before_the_first_step_are_one_restore() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    ledger.span("load", 0.5, True, None, 1.0)  # the weights
    ledger.span("load", 0.2, True, None, 1.2)  # the optimizer
    t = run_steps(ledger, 1, 2, 2.0)
    ledger.span("load", 0.3, True, None, t + 0.3)  # a restore later on is one of its own
    assert ledger.totals(t).loads_ok == 2


def test_steps_that_arrive_after_the_finish_are_kept() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    t = run_steps(ledger, 1, 3, 0.0)
    ledger.finished(t)
    ledger.step(1.0, t + 0.1)  # sent after the finish's word, done before it
    assert ledger.totals(t + 0.1).unsaved_s == 0.0
    assert ledger.totals(t + 0.1).goodput_s == pytest.approx(4.0)


def test_a_save_that_arrives_ahead_of_the_steps_before_it_is_still_a_checkpoint() -> None:
    ledger = TimeLedger()
    ledger.process(1, 0.0, 0.0)
    ledger.span("save", 0.5, True, 3, 4.0)  # the hook sends its spans ahead of queued steps
    t = run_steps(ledger, 1, 3, 4.0)
    totals = ledger.totals(t)
    assert totals.badput_s["checkpoint"] == pytest.approx(0.5)
    assert totals.badput_s["startup"] == pytest.approx(4.0)  # the first step began at 4
    assert totals.goodput_s == pytest.approx(3.0)  # the save covered the three steps
