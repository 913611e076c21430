"""Who waits on whom when a run stops: the join of its ranks' reports, table-driven."""

from __future__ import annotations

import pytest

from gpumon.analysis.stall import (
    REPORT_FRESH_S,
    SILENT_AFTER_S,
    RankProgress,
    join_run,
    location_label,
    waits_on_label,
)
from gpumon.wire import InFlight, StackFrame, StateRecord

T = 1_700_000_000.0


def report(state: str = "stalled", phase: str | None = "backward", seq: int | None = None,
           launched: int | None = None, own: str | None = "train.py:40 step") -> StateRecord:
    stack = [StackFrame("torch/_tensor.py", 600, "Tensor.backward", False)]
    if own is not None:
        file, rest = own.split(":", 1)
        line, function = rest.split(" ", 1)
        stack.append(StackFrame("jobs/" + file, int(line), function, True))
    flight = None if seq is None else InFlight("all_reduce", seq, 4096, T - 5, False)
    return StateRecord("r", 0, state, T, 15, since=T - 6, threshold_s=1.0, phase=phase,
                       launched=launched, in_flight=flight, stack=tuple(stack))


def rank(r: int, rep: StateRecord | None, age: float = 1.0, silent: float = 1.0, exited: bool = False,
         alive: bool | None = True, step_after: bool = False, steps: int = 15) -> RankProgress:
    return RankProgress(r, rep, None if rep is None else age, step_after, silent, steps, exited, alive)


def by_rank(progress: list[RankProgress]) -> dict[int, tuple[str, str, str, str, tuple[int, ...]]]:
    return {c.rank: (c.state, c.phase, c.op, c.location, c.waits_on) for c in join_run(progress)}


def test_the_rank_in_its_data_pipeline_is_what_the_rank_in_the_all_reduce_waits_on() -> None:
    out = by_rank([rank(0, report(seq=16, launched=16)),
                   rank(1, report(phase="data", launched=15, own="job.py:9 read_shard"))])
    assert out[0] == ("stalled", "backward", "all_reduce", "train.py:40 step", (1,))
    assert out[1] == ("stalled", "data", "", "job.py:9 read_shard", ())


def test_ranks_in_the_same_collective_wait_together_on_the_one_elsewhere() -> None:
    progress = [rank(r, report(seq=40)) for r in (0, 1, 3)]
    progress.append(rank(2, report(phase="forward", own="model.py:7 apply_adapter")))
    out = by_rank(progress)
    assert [out[r][4] for r in (0, 1, 3)] == [(2,), (2,), (2,)]
    assert out[2][:2] == ("stalled", "forward") and out[2][4] == ()


@pytest.mark.parametrize(("other", "waits"), [
    (rank(1, report(seq=12)), ()),  # the same collective: neither is the cause
    (rank(1, report(seq=11)), (1,)),  # an earlier one: it is behind
    (rank(1, None, exited=True), (1,)),  # its process ended
    (rank(1, report(state="stepping"), silent=SILENT_AFTER_S + 1), (1,)),  # silent, process alive
    (rank(1, report(state="stepping")), ()),  # still stepping: not stalled, not waited on
    (rank(1, report(state="stepping"), silent=SILENT_AFTER_S + 1, alive=False), ()),
])
def test_whom_a_rank_in_a_collective_waits_on(other: RankProgress, waits: tuple[int, ...]) -> None:
    assert by_rank([rank(0, report(seq=12)), other])[0][4] == waits


def test_a_stale_report_or_a_step_since_does_not_hold_a_rank_stalled() -> None:
    assert by_rank([rank(0, report(), age=REPORT_FRESH_S + 1)])[0][0] == "stepping"
    assert by_rank([rank(0, report(), step_after=True)])[0][0] == "stepping"


def test_silence_is_a_stall_only_from_a_hook_that_sends_heartbeats_and_has_stepped() -> None:
    silent = SILENT_AFTER_S + 1
    out = by_rank([rank(0, report(state="stepping"), silent=silent),
                   rank(1, None, silent=silent),  # an older hook: no heartbeats to miss
                   rank(2, report(state="stepping"), silent=silent, steps=0),
                   rank(3, report(state="closed"), silent=silent)])
    assert out[0][:2] == ("stalled", "unknown") and out[0][3].startswith("unknown: the process lives")
    assert [out[r][0] for r in (1, 2)] == ["stepping"] * 2
    assert out[3][0] == "finished"  # its monitor closed: it has nothing more to say
    [cond] = join_run([rank(0, report(state="stepping"), silent=silent)])
    assert cond.stalled_s == silent


def test_stalled_seconds_run_from_the_last_progress() -> None:
    [cond] = join_run([rank(0, report(), age=2.0)])
    assert cond.stalled_s == pytest.approx(6.0 + 2.0)


def test_phase_and_location_labels() -> None:
    out = by_rank([rank(0, report(phase=None)), rank(1, report(phase="eval_loop")),
                   rank(2, report(own=None)), rank(3, None, exited=True)])
    assert out[0][1] == "none" and out[1][1] == "other"
    assert out[2][3] == "unknown: no frame of the job's own code on the stack"
    assert out[3] == ("exited", "none", "", "", ())
    long = location_label(StackFrame("a/" + "x" * 100 + ".py", 1, "f" * 100, True))
    assert len(long) == 120 and long.endswith("…") and long.startswith("x")


def test_waits_on_shows_eight_ranks_then_a_count() -> None:
    assert waits_on_label(()) == ""
    assert waits_on_label((1,)) == "1"
    assert waits_on_label(tuple(range(8))) == "0,1,2,3,4,5,6,7"
    assert waits_on_label(tuple(range(11))) == "0,1,2,3,4,5,6,7,+3"


def test_a_vanished_rank_is_exited_where_it_was_last_seen_and_a_closed_one_finished() -> None:
    out = by_rank([rank(0, report(state="stepping", phase="forward", own="train.py:51 step"),
                        exited=True, alive=False),
                   rank(1, report(state="closed", phase=None, own=None), exited=True, alive=False),
                   rank(2, None, exited=True, alive=False),  # an older hook: no word of its end
                   rank(3, report(state="closed", phase=None, own=None))])  # closed, still running
    assert out[0] == ("exited", "forward", "", "train.py:51 step", ())
    assert out[1][0] == "finished" and out[3][0] == "finished"
    assert out[2] == ("exited", "none", "", "", ())
    [vanished, _, unknown, _] = join_run([
        rank(0, report(state="stepping"), exited=True), rank(1, report(state="closed")),
        rank(2, None, exited=True), rank(3, report(state="closed"))])
    assert vanished.placed and not unknown.placed


def test_an_evaluating_rank_is_not_stalled_and_its_waiting_peers_are_not_either() -> None:
    out = by_rank([rank(0, report(state="evaluating", phase="forward")),
                   rank(1, report(seq=30)),  # in a barrier while rank 0 evaluates
                   rank(2, report(state="evaluating"), age=REPORT_FRESH_S + 1)])  # stale
    assert out[0][:2] == ("evaluating", "forward")
    assert out[1][0] == "evaluating" and out[1][4] == (0,)
    assert out[2][0] == "stepping"
    # A peer stuck elsewhere is still what a waiting rank is stalled on.
    out = by_rank([rank(0, report(state="evaluating")), rank(1, report(seq=30)),
                   rank(2, report(phase="data", own="job.py:9 read_shard"))])
    assert out[1][0] == "stalled" and out[1][4] == (0, 2)
    [_, waiting, _] = join_run([rank(0, report(state="evaluating")), rank(1, report(seq=30)),
                                rank(2, report(phase="data"))])
    assert waiting.stalled_s is not None
    assert by_rank([rank(0, report(state="evaluating"), step_after=True)])[0][0] == "stepping"
