"""The per-step communication ledger: intervals, attribution to steps, what is not measured.

The ledger reads its clocks (``perf_counter``, ``thread_time``) through ``ManualClock`` here:
every figure is exact, whatever the machine is doing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.client.comm.intervals import MIN_QUIET_WALL_S, contention_seconds, union_seconds
from gpumon.client.comm.ledger import MAX_PENDING_OPS, CommLedger
from tests.client.conftest import ManualClock

LEDGER = "gpumon.client.comm.ledger"
OPS = "gpumon.client.comm.ops"  # where the collectives and the waits read the clock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    return ManualClock().install(monkeypatch, LEDGER).install(monkeypatch, OPS)


@pytest.fixture
def ledger(clock: ManualClock) -> Iterator[CommLedger]:
    yield CommLedger()


@pytest.mark.parametrize(
    ("intervals", "lo", "hi", "expected"),
    [
        ([], 0.0, 10.0, 0.0),
        ([(1.0, 2.0)], 0.0, 10.0, 1.0),
        ([(1.0, 3.0), (2.0, 4.0)], 0.0, 10.0, 3.0),  # overlapping: counted once
        ([(2.0, 4.0), (1.0, 3.0), (6.0, 7.0)], 0.0, 10.0, 4.0),  # any order
        ([(1.0, 5.0), (2.0, 3.0)], 0.0, 10.0, 4.0),  # nested
        ([(-5.0, 2.0), (9.0, 20.0)], 0.0, 10.0, 3.0),  # clipped to the window
        ([(11.0, 12.0), (-3.0, -1.0)], 0.0, 10.0, 0.0),  # outside it
        ([(3.0, 2.0)], 0.0, 10.0, 0.0),  # backwards: nothing
    ],
)
def test_union_seconds(intervals: list[tuple[float, float]], lo: float, hi: float, expected: float) -> None:
    assert union_seconds(intervals, lo, hi) == pytest.approx(expected)


def _past_step(ledger: CommLedger, clock: ManualClock, seconds: float = 0.02) -> float:
    """Begin a step and let ``seconds`` pass, so intervals can be placed inside it; its start."""
    ledger.step_begin()
    t_begin = clock()
    clock.advance(seconds)
    return t_begin


def test_a_step_reports_its_collectives_by_kind(ledger: CommLedger, clock: ManualClock) -> None:
    t = _past_step(ledger, clock)
    a = ledger.launched("all_reduce", 1000, t + 0.001, t + 0.002, True)
    b = ledger.launched("all_reduce", 500, t + 0.003, t + 0.004, True)
    c = ledger.launched("broadcast", 8, t + 0.010, t + 0.011, True)
    assert a is not None and b is not None and c is not None
    a.t_done, b.t_done, c.t_done = t + 0.006, t + 0.008, t + 0.011
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    comm = fields["comm"]
    assert isinstance(comm, dict)
    assert comm["ops"] == {
        "all_reduce": [2, 1500, pytest.approx(0.005 + 0.005)],
        "broadcast": [1, 8, pytest.approx(0.001)],
    }
    assert comm["busy"] == pytest.approx(0.007 + 0.001)  # [1, 8] ms and [10, 11] ms
    # Launching on the training thread held it for 1 ms each (the broadcast returned done).
    assert comm["exposed"] == pytest.approx(0.003)
    assert comm["exposed"] <= comm["busy"]


def test_a_wait_ends_at_the_last_completion_or_when_resumed(ledger: CommLedger, clock: ManualClock) -> None:
    t = _past_step(ledger, clock)
    op = ledger.launched("all_reduce", 4, t + 0.001, t + 0.002, True)
    assert op is not None
    op.t_done = t + 0.009
    assert ledger.wait_from(t + 0.002) is not None  # nobody stamped its end: the completion does
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    assert fields["comm"]["exposed"] == pytest.approx(0.008)  # type: ignore[index]

    t = _past_step(ledger, clock, 0.015)
    op = ledger.launched("all_reduce", 4, t + 0.001, t + 0.002, True)
    assert op is not None
    op.t_done = t + 0.009
    tail = ledger.wait_from(t + 0.002)
    assert tail is not None
    tail.resumed()  # the waiter resumed 6 ms after the completion (copying buckets back, say)
    clock.advance(0.005)  # the rest of the step
    fields = {}
    ledger.step_end(fields)
    comm = fields["comm"]
    assert comm["exposed"] == pytest.approx(0.014)  # type: ignore[index]  # [1, 15] ms
    # the wait after the completion is communication's too: busy covers it
    assert comm["busy"] == pytest.approx(comm["exposed"])  # type: ignore[index]


def test_an_operation_across_a_step_end_is_counted_once(ledger: CommLedger, clock: ManualClock) -> None:
    t = _past_step(ledger, clock)
    op = ledger.launched("all_gather", 64, t + 0.005, t + 0.006, True)
    assert op is not None
    first: dict[str, object] = {}
    ledger.step_end(first)
    # Still in flight: its time so far is this step's, its count waits for its completion.
    assert first["comm"]["ops"] == {}  # type: ignore[index]
    assert first["comm"]["busy"] == pytest.approx(0.015)  # type: ignore[index]  # [5, 20] ms

    t2 = _past_step(ledger, clock)
    op.t_done = t2 + 0.004
    second: dict[str, object] = {}
    ledger.step_end(second)
    assert second["comm"]["ops"] == {"all_gather": [1, 64, pytest.approx(0.019)]}  # type: ignore[index]
    assert second["comm"]["busy"] == pytest.approx(0.004)  # type: ignore[index]

    third: dict[str, object] = {}
    _past_step(ledger, clock, 0.001)
    ledger.step_end(third)
    assert third["comm"] == {"exposed": 0.0, "busy": 0.0, "ops": {}}


def test_a_completed_collective_whose_callback_lags_is_counted_in_its_step(
        ledger: CommLedger, clock: ManualClock) -> None:
    # A future wakes its waiters before it runs its callbacks: the training thread can close
    # its step while the thread that completed the work has not stamped it yet.
    import torch

    t = _past_step(ledger, clock)
    op = ledger.launched("all_reduce", 64, t + 0.005, t + 0.006, True)
    assert op is not None
    future: torch.futures.Future[None] = torch.futures.Future()
    op.future = future  # as the tap keeps it; its callback (op.done) has not run
    future.set_result(None)
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    assert fields["comm"]["ops"] == {"all_reduce": [1, 64, pytest.approx(0.015)]}  # type: ignore[index]
    op.done()  # the late callback changes nothing already reported
    later: dict[str, object] = {}
    _past_step(ledger, clock, 0.001)
    ledger.step_end(later)
    assert later["comm"]["ops"] == {}  # type: ignore[index]


def test_collectives_outside_steps_are_not_counted(ledger: CommLedger, clock: ManualClock) -> None:
    t = clock()
    assert ledger.launched("barrier", 0, t, t + 0.001, True) is None
    assert ledger.outside_steps == 1
    _past_step(ledger, clock, 0.001)
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    assert fields["comm"] == {"exposed": 0.0, "busy": 0.0, "ops": {}}


def test_a_step_with_an_untimed_collective_reports_no_comm(ledger: CommLedger, clock: ManualClock) -> None:
    t = _past_step(ledger, clock)
    op = ledger.launched("all_reduce", 4, t, t + 0.001, host_timed=False)
    assert op is not None
    op.t_done = t + 0.001
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    assert "comm" not in fields and ledger.steps_not_timed == 1
    _past_step(ledger, clock, 0.001)
    ledger.step_end(fields)  # the next step, with nothing untimed, is measured again
    assert "comm" in fields and ledger.steps_measured == 1


def test_a_blind_ledger_reports_nothing(ledger: CommLedger, clock: ManualClock) -> None:
    ledger.blind = True  # e.g. DDP with a built-in C++ comm hook: its all-reduces are invisible
    _past_step(ledger, clock, 0.001)
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    assert fields == {}


def test_operations_that_never_complete_are_bounded(ledger: CommLedger, clock: ManualClock) -> None:
    t = _past_step(ledger, clock, 0.001)
    for _ in range(MAX_PENDING_OPS + 10):
        ledger.launched("all_reduce", 4, t, t, True)  # a dead peer: nothing ever completes
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    assert ledger.dropped_ops == 10
    assert fields["comm"]["ops"] == {}  # type: ignore[index]


def test_the_inferred_wait_runs_from_the_last_launch_to_the_last_completion(
        ledger: CommLedger, clock: ManualClock) -> None:
    ledger.infer_tail = True
    t = _past_step(ledger, clock)
    first = ledger.launched("all_reduce", 4, t + 0.001, t + 0.002, True)
    last = ledger.launched("all_reduce", 4, t + 0.003, t + 0.004, True)
    assert first is not None and last is not None
    first.t_done, last.t_done = t + 0.005, t + 0.010
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    # launches [1, 2] and [3, 4] ms, then the wait [4, 10] ms
    assert fields["comm"]["exposed"] == pytest.approx(0.001 + 0.007)  # type: ignore[index]


def test_a_mirrored_wait_counts_the_copy_after_the_last_completion_twice(
        ledger: CommLedger, clock: ManualClock) -> None:
    t = _past_step(ledger, clock, 0.03)  # backward ran 15 ms, copying gradients into the bucket
    op = ledger.launched("all_reduce", 4, t + 0.015, t + 0.016, True)
    assert op is not None
    tail = ledger.wait_from(t + 0.016, mirrored=True)
    assert tail is not None
    op.t_done = t + 0.020  # copying the buckets back took the last 10 ms of the wait
    tail.resumed()  # at 30 ms
    clock.advance(0.02)  # the rest of the step (the optimizer, say)
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    comm = fields["comm"]
    # The wait [15, 30] ms, and the copy into the bucket taken to cost the copy back: 10 ms.
    assert comm["exposed"] == pytest.approx(0.015 + 0.010)  # type: ignore[index]
    assert comm["busy"] == pytest.approx(comm["exposed"])  # type: ignore[index]


@given(st.lists(st.tuples(st.floats(-0.05, 0.1), st.floats(0, 0.05), st.floats(0, 0.2) | st.none(),
                          st.booleans()), max_size=20),
       st.lists(st.tuples(st.floats(-0.05, 0.1), st.floats(0, 0.05)), max_size=5),
       st.floats(0.0, 0.2))
@settings(max_examples=200, deadline=None)
def test_figures_stay_within_the_step_whatever_the_timings(
    ops: list[tuple[float, float, float | None, bool]], waits: list[tuple[float, float]], window: float
) -> None:
    # Whatever launches, completions (late, never, before the launch) and waits: what reaches
    # the wire is finite, non-negative, exposed <= busy <= the step's window.
    with pytest.MonkeyPatch.context() as monkeypatch:
        clock = ManualClock().install(monkeypatch, LEDGER).install(monkeypatch, OPS)
        ledger = CommLedger()
        ledger.step_begin()
        t = clock()
        for start, length, done, on_thread in ops:
            op = ledger.launched("all_reduce", 4, t + start, t + start + length, True)
            assert op is not None
            op.on_training_thread = on_thread
            op.t_done = None if done is None else t + start + done
        for start, length in waits:
            ledger.blocked(t + start, t + start + length)
        ledger.infer_tail = True
        clock.advance(window)
        fields: dict[str, object] = {}
        ledger.step_end(fields)
    comm = fields["comm"]
    assert isinstance(comm, dict)
    # (1e-9: the rounding of differences between clock readings near 1000 s, not time)
    assert 0.0 <= comm["exposed"] <= comm["busy"] <= window + 1e-9
    for count, size, seconds in comm["ops"].values():
        assert count >= 1 and size >= 0 and seconds >= 0.0


def test_cpu_lost_while_collectives_overlap_work_is_exposed() -> None:
    # The training thread's clocks (wall, CPU) over a 100 ms step: 20 ms of forward with no
    # collective in flight, 2 ms off a CPU (the node's usual rate, 10 %); then a bucket's
    # launch (blocked, [20, 21] ms) and 40 ms of backward beside it, 14 ms of them off a CPU;
    # then the wait for it ([61, 90] ms, counted as blocked already); then 10 ms of optimizer.
    clocks = [(0.0, 0.0), (0.020, 0.018), (0.021, 0.019), (0.061, 0.045), (0.090, 0.046), (0.100, 0.055)]
    busy = [(0.020, 0.090)]
    blocked = [(0.020, 0.021), (0.061, 0.090)]
    # 14 ms off a CPU in flight, less the 10 % the thread loses anyway (forward and optimizer:
    # 3 ms of 30 ms) over those 40 ms.
    assert contention_seconds(clocks, busy, blocked) == pytest.approx(0.014 - 0.1 * 0.040)
    # No collective in flight: nothing is contention, whatever the thread lost.
    assert contention_seconds(clocks, [], blocked) == 0.0
    # Losing less than usual beside the collectives is not negative contention.
    calm = [(0.0, 0.0), (0.020, 0.010), (0.021, 0.011), (0.061, 0.050), (0.100, 0.080)]
    assert contention_seconds(calm, busy, blocked) == 0.0


def _contention_by_definition(clocks: list[tuple[float, float]], busy: list[tuple[float, float]],
                              blocked: list[tuple[float, float]]) -> float:
    """The contention of architecture §5.1 spelt out span by span, each union measured anew."""
    spans, quiet_wall, quiet_off = [], 0.0, 0.0
    readings = sorted(clocks)
    for (wa, ca), (wb, cb) in zip(readings, readings[1:], strict=False):
        wall = wb - wa
        if wall <= 0.0 or union_seconds(blocked, wa, wb) > 0.0:
            continue
        off, share = max(0.0, wall - (cb - ca)), union_seconds(busy, wa, wb) / wall
        spans.append((wall, off, share))
        quiet_wall += wall * (1 - share)
        quiet_off += off * (1 - share)
    rate = quiet_off / quiet_wall if quiet_wall > MIN_QUIET_WALL_S else 0.0
    return max(0.0, sum((off - rate * wall) * share for wall, off, share in spans))


_moments = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
_intervals = st.lists(st.tuples(_moments, _moments).map(sorted).map(tuple), max_size=12)


@settings(max_examples=300, deadline=None)
@given(walls=st.lists(_moments, min_size=2, max_size=24, unique=True),
       cpu_shares=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=24, max_size=24),
       busy=_intervals, blocked=_intervals)
def test_contention_in_one_sweep_is_the_definition_span_by_span(
    walls: list[float], cpu_shares: list[float], busy: list[tuple[float, float]],
    blocked: list[tuple[float, float]],
) -> None:
    walls.sort()
    clocks, cpu = [(walls[0], 0.0)], 0.0
    for (a, b), share in zip(zip(walls, walls[1:], strict=False), cpu_shares, strict=False):
        cpu += (b - a) * share
        clocks.append((b, cpu))
    assert contention_seconds(clocks, busy, blocked) == pytest.approx(
        _contention_by_definition(clocks, busy, blocked), abs=1e-12)


def test_a_step_in_flight_throughout_but_a_rounding_error_has_no_quiet_rate_of_its_own() -> None:
    # The union of these three is all of [0, 0.5] but for ~1e-16 s of float rounding: the
    # thread spent the span off a CPU with a collective in flight, which is all contention.
    clocks = [(0.0, 0.0), (0.5, 0.0)]
    busy = [(0.0, 1.0), (0.0, 0.36526672106656394), (0.0, 0.1)]
    assert contention_seconds(clocks, busy, []) == pytest.approx(0.5)


def test_a_step_with_contention_counts_it_as_exposed(ledger: CommLedger, clock: ManualClock) -> None:
    # The training thread's CPU clock runs at 40 % of the wall clock beside the collective,
    # and stops while it waits; the ledger reads it at the step's edges and the wait's.
    ledger.step_begin()
    t = clock()
    op = ledger.launched("all_reduce", 4, t, t + 0.0001, True, (0.0, 0.00004))
    assert op is not None
    ledger.blocked(t + 0.030, t + 0.040, (0.012, 0.012))
    op.t_done = t + 0.035
    clock.advance(0.045, cpu_s=0.017)  # at the step's end
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    comm = fields["comm"]
    assert isinstance(comm, dict)
    # The launch and the wait (10.1 ms), plus the 17.94 ms lost beside the collective over
    # [0.1, 30] ms; after the wait, the thread had its CPU (the quiet rate is 0).
    assert comm["exposed"] == pytest.approx(0.0101 + 0.0299 - 0.01196)
    assert comm["exposed"] <= comm["busy"]
