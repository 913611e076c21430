"""The rank cap shared between processes, not only users: a flood from one process never
delays another process's new job of the same uid, and each refusal names its rule."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

from gpumon.collectors.samples import SenderCredentials
from gpumon.collectors.sender_shares import SenderShares
from gpumon.state.ranks import IDLE_EVICT_S, RankStore
from gpumon.wire import HelloRecord, StepRecord
from tests.helpers import ROOT, library_agent, scrape_metrics, value, wait_for

NOW = 1_800_000_000.0
FLOOD_LABELS = 50_000
FLOOD_S = 25.0
ROOT_FLOOD = SenderCredentials(pid=4100, uid=0)
ROOT_JOB = SenderCredentials(pid=4200, uid=0)
ROOT_JOB_2 = SenderCredentials(pid=4300, uid=0)
ALICE = SenderCredentials(pid=5100, uid=1000)


def step(run: str, rank: int, n: int = 0) -> StepRecord:
    return StepRecord(run=run, rank=rank, step=n, duration_s=0.5, t_start=NOW - 0.5)


def flood(store: RankStore, start: int, count: int, t0: float, per_s: float,
          batch: int = 100) -> float:
    """``count`` distinct (run, rank) labels from ROOT_FLOOD, ``batch`` a datagram, paced at
    ``per_s`` on the store's clock from ``t0``; returns the clock after the last one."""
    t = t0
    for first in range(start, start + count, batch):
        t = t0 + (first - start) / per_s
        store.ingest([step(f"flood-{i}", i % 8) for i in range(first, first + batch)],
                     ROOT_FLOOD, t, NOW)
    return t


def steps_of(store: RankStore, run: str) -> int:
    return sum(s.steps_total for s in store.ranks() if s.run == run)


def test_after_one_process_floods_another_of_the_same_uid_gets_every_step() -> None:
    store = RankStore()
    t = flood(store, 0, FLOOD_LABELS, 0.0, FLOOD_LABELS / FLOOD_S)
    assert t <= FLOOD_S
    assert len(store.ranks()) == store.max_ranks  # the flood alone may fill the cap ...
    dropped = store.counters()[1]
    assert dropped == {"too_many_ranks": FLOOD_LABELS - store.max_ranks}
    # ... and a new process of the same uid sends 500 steps of a new run at once.
    records = [step("next-job", rank, n) for n in range(125) for rank in range(4)]
    accepted = store.ingest(records, ROOT_JOB, FLOOD_S, NOW)
    assert len(accepted) == 500
    assert steps_of(store, "next-job") == 500
    assert store.counters()[1] == dropped  # nothing of the job refused
    assert store.evictions() == {"process_over_share": 4}


def test_a_flood_going_on_never_delays_a_new_process_by_a_step() -> None:
    store = RankStore(max_ranks=1024)
    t = flood(store, 0, 20_000, 0.0, 2000.0)
    # Two jobs of the same uid start while the flood goes on: 64 and 8 ranks, a step of
    # every rank between each of the flood's datagrams.
    sent = 0
    for n in range(10):
        for job, ranks, who in (("job-a", 64, ROOT_JOB), ("job-b", 8, ROOT_JOB_2)):
            accepted = store.ingest([step(job, r, n) for r in range(ranks)], who, t, NOW)
            assert len(accepted) == ranks, (job, n)
            sent += ranks
        t = flood(store, 20_000 + 1000 * n, 1000, t + 0.01, 2000.0)
    assert steps_of(store, "job-a") + steps_of(store, "job-b") == sent == 720
    dropped = store.counters()[1]
    # The flood, at its share once the jobs hold pairs, is refused by the process rule.
    assert set(dropped) == {"too_many_ranks", "too_many_ranks_process"}
    assert dropped["too_many_ranks_process"] > 0
    # The jobs' pairs (72) are all live; the flood holds the rest of the cap.
    assert len(store.ranks()) == 1024


def test_a_process_share_is_bounded_but_users_come_first() -> None:
    store = RankStore(max_ranks=100)
    store.ingest([HelloRecord(run=f"f{i}", rank=0) for i in range(100)], ROOT_FLOOD, 0.0, NOW)
    # Another process of root gets up to half of root's pairs, then is refused by its rule.
    store.ingest([step("job", r) for r in range(60)], ROOT_JOB, 1.0, NOW)
    assert sum(1 for s in store.ranks() if s.run == "job") == 50
    assert store.counters()[1] == {"too_many_ranks_process": 10}
    assert store.evictions() == {"process_over_share": 50}
    # A new user takes its share of the cap (half, with two users) from root's processes,
    # the bigger of the two each time: root's two processes keep a quarter each.
    store.ingest([step("alice", r) for r in range(60)], ALICE, 2.0, NOW)
    held = Counter((s.uid, s.run == "job") for s in store.ranks())
    assert held == {(1000, False): 50, (0, True): 25, (0, False): 25}
    assert store.counters()[1] == {"too_many_ranks_process": 10, "too_many_ranks": 10}
    assert store.evictions() == {"process_over_share": 50, "over_share": 50}


def test_a_rank_moves_to_the_process_that_sends_it_now() -> None:
    shares: SenderShares[str] = SenderShares(max_pairs=4, idle_evict_s=IDLE_EVICT_S)
    for key in "abcd":
        shares.add(key, (0, 1))
    shares.touch("a", (0, 2))  # rank "a" restarted as a new process
    assert shares.senders() == {(0, 1): 3, (0, 2): 1}
    # pid 2 is below its share (4 // 2) of root's pairs: pid 1's oldest pair ("b") gives way.
    last_seen = {"a": 5.0, "b": 1.0, "c": 2.0, "d": 3.0}
    assert shares.make_room((0, 2), 6.0, last_seen.__getitem__) == ("b", "process_over_share")
    # pid 1 at its share, nothing quiet for a minute: refused by the process rule.
    assert shares.make_room((0, 1), 6.0, last_seen.__getitem__) == (None,
                                                                     "too_many_ranks_process")
    # Quiet for a minute, the user's oldest pair gives way to either.
    assert shares.make_room((0, 1), 1.0 + IDLE_EVICT_S, last_seen.__getitem__) == ("b", "idle")


_SENDER = """
import socket, sys, time
from gpumon.wire import encode_record, pack_datagrams
path, run, labels, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
now = time.time()
if labels:  # a run name per record: one rank of a new run each time
    records = [{"v": 1, "kind": "step", "run": f"{run}-{i}", "rank": 0, "step": 0,
                "duration": 0.01, "t_start": now - 0.01} for i in range(labels)]
else:
    records = [{"v": 1, "kind": "step", "run": run, "rank": 0, "step": k, "duration": 0.01,
                "t_start": now - 0.01} for k in range(steps)]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # blocking: the kernel loses nothing
start = time.monotonic()
for datagram, _count in pack_datagrams(encode_record(r) for r in records):
    sock.sendto(datagram, path)
print(time.monotonic() - start)
"""


def _send(path: Path, run: str, labels: int, steps: int) -> float:
    """Send from a new process (its own pid, our uid); the seconds its sending took."""
    done = subprocess.run([sys.executable, "-c", _SENDER, str(path), run, str(labels),
                           str(steps)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_through_the_socket_a_new_process_of_the_same_uid_gets_all_500_steps(
        tmp_path: Path) -> None:
    path = tmp_path / "ingest.sock"
    with library_agent(path, collectors=("ingest",)) as agent:
        store = agent.rank_store
        seconds = _send(path, "flood", FLOOD_LABELS, 0)
        assert seconds <= FLOOD_S

        def flood_handled() -> bool:
            records, dropped = store.counters()
            return records.get("step", 0) + sum(dropped.values()) >= FLOOD_LABELS

        wait_for(flood_handled, timeout=60, what="the flood handled")
        assert len(store.ranks()) == store.max_ranks
        _send(path, "next-job", 0, 500)
        wait_for(lambda: steps_of(store, "next-job") >= 500, timeout=30,
                 what="the new job's 500 steps")
        m = scrape_metrics(agent)
        assert value(m, "gpumon_steps_total", run="next-job", rank="0") == 500
        assert value(m, "gpumon_ingest_dropped_total",
                     reason="too_many_ranks") == FLOOD_LABELS - store.max_ranks
        assert value(m, "gpumon_ingest_ranks_evicted_total", reason="process_over_share") == 1
        pids = {s.pid for s in store.ranks()}
        assert len(pids) == 2  # the kernel told the two processes apart
