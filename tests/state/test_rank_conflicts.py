"""Two live processes are never one rank: the store's conflict logic, with liveness given as a
set of pids (the agent's real check reads ``/proc``: tests/e2e/test_two_jobs.py)."""

from __future__ import annotations

from pathlib import Path

from gpumon.collectors.liveness import ProcessLiveness
from gpumon.collectors.samples import SenderCredentials
from gpumon.state.rank_conflicts import clash_run
from gpumon.state.ranks import RankStore
from gpumon.wire import MAX_RUN_CHARS, StepRecord

NOW = 1_800_000_000.0


def step(n: int, pid: int | None = None, run: str = "train") -> StepRecord:
    return StepRecord(run=run, rank=0, step=n, duration_s=0.05, t_start=NOW - 0.05, pid=pid)


def totals(store: RankStore) -> dict[str, tuple[int, int | None]]:
    return {s.run: (s.steps_total, s.pid) for s in store.ranks()}


class Alive:
    """The pids taken as running; counts the questions (each one a /proc read in the agent)."""

    def __init__(self, *pids: int) -> None:
        self.pids, self.asked = set(pids), 0

    def __call__(self, pid: int) -> bool:
        self.asked += 1
        return pid in self.pids


def test_a_second_live_process_is_watched_apart_and_counted() -> None:
    alive = Alive(100, 200)
    store = RankStore(alive=alive)
    first, second = SenderCredentials(pid=100, uid=1000), SenderCredentials(pid=200, uid=1000)
    for n in range(6):
        store.ingest([step(n)], first, 1.0 + n, NOW)
        if n % 2:
            store.ingest([step(n)], second, 1.0 + n, NOW)
    assert totals(store) == {"train": (6, 100), "train:clash-200": (3, 200)}
    assert store.conflicts() == {("train", 0): 1}
    assert alive.asked == 1  # decided once, then remembered: no /proc per datagram
    assert store.watched_pids() == {100: [("train", 0)], 200: [("train:clash-200", 0)]}


def test_a_new_process_after_the_old_one_exited_continues_the_rank() -> None:
    alive = Alive(300)
    store = RankStore(alive=alive)
    store.ingest([step(0), step(1)], SenderCredentials(pid=100, uid=1000), 1.0, NOW)
    # not yet marked exited by the agent's 5 s check: the claim itself asks
    store.ingest([step(2)], SenderCredentials(pid=300, uid=1000), 2.0, NOW)
    store.mark_exited({300}, 3.0)  # seen to exit: the next process is its restart unasked
    store.ingest([step(3)], SenderCredentials(pid=400, uid=1000), 4.0, NOW)
    assert totals(store) == {"train": (4, 400)}
    assert store.conflicts() == {} and alive.asked == 1


def test_without_a_liveness_check_every_new_process_is_a_restart() -> None:
    store = RankStore()
    store.ingest([step(0)], SenderCredentials(pid=100, uid=1000), 1.0, NOW)
    store.ingest([step(1)], SenderCredentials(pid=200, uid=1000), 2.0, NOW)
    assert totals(store) == {"train": (2, 200)} and store.conflicts() == {}


def test_another_users_claim_stays_refused() -> None:
    store = RankStore(alive=Alive(100, 666))
    store.ingest([step(0)], SenderCredentials(pid=100, uid=1000), 1.0, NOW)
    store.ingest([step(1)], SenderCredentials(pid=666, uid=1666), 2.0, NOW)
    assert totals(store) == {"train": (1, 100)} and store.conflicts() == {}
    assert store.counters()[1] == {"not_owner": 1}


def test_unseen_pid_namespaces_cannot_tell_until_a_replaced_process_comes_back() -> None:
    """The kernel gives pid 0 (None here) for a sender in a pid namespace the agent cannot
    see: a change of the reported pid is taken as a restart; the old pid sending again is not."""
    store = RankStore(alive=Alive())
    hidden = SenderCredentials(pid=None, uid=1000)
    store.ingest([step(0, pid=7)], hidden, 1.0, NOW)
    store.ingest([step(1, pid=9)], hidden, 2.0, NOW)  # a restart, as far as anyone can tell
    assert totals(store) == {"train": (2, 9)} and store.conflicts() == {}
    store.ingest([step(2, pid=7), step(3, pid=7)], hidden, 3.0, NOW)
    store.ingest([step(4, pid=9)], hidden, 4.0, NOW)
    assert totals(store) == {"train": (3, 9), "train:clash-7": (2, 7)}
    assert store.conflicts() == {("train", 0): 1}


def test_the_count_and_routes_go_with_the_rank() -> None:
    store = RankStore(ttl_s=10.0, alive=Alive(100, 200))
    store.ingest([step(0)], SenderCredentials(pid=100, uid=1000), 1.0, NOW)
    store.ingest([step(0)], SenderCredentials(pid=200, uid=1000), 1.0, NOW)
    assert store.conflicts() == {("train", 0): 1}
    assert sorted(store.expire(20.0)) == [("train", 0), ("train:clash-200", 0)]
    assert store.conflicts() == {}
    store.ingest([step(1)], SenderCredentials(pid=200, uid=1000), 21.0, NOW)
    assert totals(store) == {"train": (1, 200)}  # alone now: the rank is its own


def test_a_clash_name_is_a_valid_run_of_bounded_length() -> None:
    assert clash_run("train", 4242) == "train:clash-4242"
    assert len(clash_run("x" * MAX_RUN_CHARS, 4194304)) == MAX_RUN_CHARS


def test_liveness_of_one_pid_reads_proc(tmp_path: Path) -> None:
    stat = tmp_path / "42" / "stat"
    stat.parent.mkdir()
    stat.write_text("42 (python3 (x)) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5000 0 0")
    liveness = ProcessLiveness(tmp_path)
    assert liveness.alive(42) and not liveness.alive(43)
    assert liveness.ended({42}) == set()
    stat.write_text("42 (python3) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 9000 0 0")
    assert not liveness.alive(42)  # the pid now belongs to another process
    stat.write_text("42 (python3) Z 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5000 0 0")
    assert not liveness.alive(42)


def test_a_clash_is_no_restart_and_a_restart_before_the_exit_was_seen_is_one() -> None:
    """Where each rank's time went (``gpumon_rank_restarts_total``): a second live job under
    the run's name is not a restart of its ranks; a successor whose predecessor ended before
    the agent's check saw it is one, its start taken from the kernel."""
    alive = Alive(100, 200)
    starts = {100: 0.5, 200: 1.5, 300: 9.0}
    store = RankStore(alive=alive, started=starts.get)
    store.ingest([step(0)], SenderCredentials(pid=100, uid=1000), 1.0, NOW)
    store.ingest([step(0)], SenderCredentials(pid=200, uid=1000), 2.0, NOW)  # alive: a clash
    totals = store.time_totals(3.0)
    assert totals[("train", 0)].restarts == 0 and totals[("train:clash-200", 0)].restarts == 0
    alive.pids.discard(100)  # 100 dies; no exit check has run yet when 300 starts
    store.ingest([step(1)], SenderCredentials(pid=300, uid=1000), 10.0, NOW)
    totals = store.time_totals(10.0)
    assert totals[("train", 0)].restarts == 1
    assert totals[("train", 0)].restarted_at == (9.0,)
    assert totals[("train", 0)].badput_s["lost"] == 0.05  # its unsaved step
