"""Agent-side ingest over a real Unix datagram socket: counting, validation, safety."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from gpumon.agent.config import AgentConfig
from gpumon.agent.lifecycle import Agent
from gpumon.collectors.ingest import (
    PRESSURE_DATAGRAMS,
    PROCESS_SHARE_DATAGRAMS,
    IngestError,
    IngestServer,
    bind_socket,
)
from gpumon.collectors.samples import SenderCredentials
from gpumon.state.ranks import RankStore
from gpumon.wire import MAX_DATAGRAM_BYTES
from tests.helpers import (
    http_get,
    scrape_metrics,
    value,
    values,
    wait_for,
)


def step(run: str = "r", rank: int = 0, n: int = 0, **extra: object) -> dict[str, object]:
    record: dict[str, object] = {"v": 1, "kind": "step", "run": run, "rank": rank, "step": n,
                                 "duration": 0.5}
    record.update(extra)
    return record


def send(path: Path, payload: bytes | object) -> None:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, str(path))


pytestmark = pytest.mark.agent(library=True, socket="run/ingest.sock", collectors=("ingest", "host"))


metrics = scrape_metrics


def test_socket_is_created_0660_in_a_new_directory(agent: Agent) -> None:
    path = Path(agent.config.socket)
    mode = path.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o660


def test_steps_phases_samples_tokens_counted_exactly(agent: Agent) -> None:
    path = Path(agent.config.socket)
    t0 = float(int(time.time()) - 20)
    batch = [step(n=i, phases={"data": 0.1, "forward": 0.2, "backward": 0.15, "custom": 0.01},
                  samples=32, tokens=4096, flops=1e12, t_start=t0 + i)
             for i in range(10)]
    send(path, batch)
    send(path, step(rank=1, n=0))
    wait_for(lambda: values(metrics(agent), "gpumon_steps_total", run="r", rank="1"))
    m = metrics(agent)
    assert value(m, "gpumon_steps_total", run="r", rank="0") == 10
    assert value(m, "gpumon_step_phase_seconds_total", run="r", rank="0",
                 phase="forward") == pytest.approx(2.0)
    assert value(m, "gpumon_step_phase_seconds_total", run="r", rank="0",
                 phase="other") == pytest.approx(0.1)
    assert value(m, "gpumon_samples_total", run="r", rank="0") == 320
    assert value(m, "gpumon_tokens_total", run="r", rank="0") == 40960
    assert value(m, "gpumon_step_flops_total", run="r", rank="0") == pytest.approx(1e13)
    assert value(m, "gpumon_step_duration_seconds_count", run="r", rank="0") == 10
    assert value(m, "gpumon_step_duration_seconds_bucket", run="r", rank="0", le="0.5") == 10
    assert value(m, "gpumon_step_duration_seconds_bucket", run="r", rank="0", le="0.25") == 0
    assert value(m, "gpumon_step_last_timestamp_seconds", run="r", rank="0") == t0 + 9.5
    assert value(m, "gpumon_ingest_records_total", kind="step") == 11
    # The kernel's credentials, not the record, say who sent it.
    assert value(m, "gpumon_rank_info", run="r", rank="0", pid=str(os.getpid())) == 1


def test_memory_stats_and_oom_events(agent: Agent) -> None:
    path = Path(agent.config.socket)
    send(path, step(n=1, mem={"allocated": 10, "reserved": 20, "peak": 15, "retries": 2,
                              "ooms": 0}))
    send(path, {"v": 1, "kind": "event", "event": "oom", "run": "r", "rank": 0, "step": 2})
    wait_for(lambda: values(metrics(agent), "gpumon_torch_ooms_total", run="r", rank="0") == [1.0])
    m = metrics(agent)
    assert value(m, "gpumon_torch_memory_allocated_bytes", run="r", rank="0") == 10
    assert value(m, "gpumon_torch_memory_reserved_bytes", run="r", rank="0") == 20
    assert value(m, "gpumon_torch_memory_peak_bytes", run="r", rank="0") == 15
    assert value(m, "gpumon_torch_alloc_retries_total", run="r", rank="0") == 2


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xff\xfe", "not_utf8"),
        (b"{not json", "not_json"),
        (b"42", "not_object"),
        ({"v": 2, "kind": "step", "run": "r", "rank": 0, "step": 0, "duration": 1}, "bad_version"),
        ({"v": 1, "kind": "metrics"}, "bad_kind"),
        ({"v": 1, "kind": "step", "run": "r", "rank": 0, "step": 0}, "missing_field"),
        (step(duration=-1.0), "bad_value"),
        (step(duration=1e9), "bad_value"),
        (step(rank=True), "bad_type"),
        (step(run="bad run{label}"), "bad_label"),
        (b"[" + b"0," * 300 + b"0]", "too_many_records"),
        (b"x" * (MAX_DATAGRAM_BYTES + 100), "too_large"),
    ],
)
def test_bad_datagrams_are_dropped_and_counted(agent: Agent, payload: object, reason: str) -> None:
    send(Path(agent.config.socket), payload)
    send(Path(agent.config.socket), step(run="after"))  # the agent keeps ingesting
    wait_for(lambda: values(metrics(agent), "gpumon_steps_total", run="after"))
    assert value(metrics(agent), "gpumon_ingest_dropped_total", reason=reason) >= 1


def test_mixed_batch_keeps_the_good_records(agent: Agent) -> None:
    send(Path(agent.config.socket), [step(n=1), step(duration="slow"), step(n=2)])
    wait_for(lambda: values(metrics(agent), "gpumon_steps_total", run="r") == [2.0])
    assert value(metrics(agent), "gpumon_ingest_dropped_total", reason="bad_type") == 1


def test_uid_allow_list_uses_kernel_credentials(tmp_path: Path) -> None:
    received: list[object] = []
    dropped: list[str] = []
    path = tmp_path / "ingest.sock"
    server = IngestServer(path, lambda records, sender: received.extend(records),
                          lambda reason, n: dropped.append(reason),
                          allowed_uids=(os.getuid() + 12345,))
    server.start()
    try:
        send(path, step())
        wait_for(lambda: dropped, what="a counted drop")
        assert dropped == ["uid_not_allowed"] and received == []
    finally:
        server.stop()
    assert not path.exists()


def test_settled_is_told_once_the_records_are_taken_in(tmp_path: Path) -> None:
    events: list[str] = []
    path = tmp_path / "ingest.sock"
    server = IngestServer(path, lambda records, sender: events.append("records"),
                          lambda reason, n: events.append(reason),
                          on_settled=lambda: events.append("settled"))
    server.start()
    try:
        send(path, b"not json")
        wait_for(lambda: events, what="the bad datagram counted")
        send(path, [step(n=0), step(n=1)])
        wait_for(lambda: "settled" in events, what="settled after the records")
        assert events == [events[0], "records", "settled"]  # none for the refused datagram
    finally:
        server.stop()


SENDER = """
import json, socket, sys
path, datagrams, steps, run = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    for n in range(datagrams):  # blocking sends: the kernel loses none
        s.sendto(json.dumps([{"v": 1, "kind": "step", "run": run, "rank": 0, "step": n * steps + k,
                              "duration": 0.5} for k in range(steps)]).encode(), path)
"""


def test_a_flooding_process_cannot_crowd_out_another_process_s_steps(tmp_path: Path) -> None:
    """The decoder held up (a busy node): one process sends more datagrams than the queue
    holds, then a new process of the same user sends 500 steps at once (batched, as the hook
    sends them). Every one of the new process's steps is decoded; the flood's excess is
    refused by the process rule, not by a full queue."""
    path = tmp_path / "ingest.sock"
    release = threading.Event()
    steps: Counter[int | None] = Counter()
    dropped: Counter[str] = Counter()

    def on_records(records: list[object], sender: SenderCredentials) -> None:
        release.wait(60)
        steps[sender.pid] += len(records)

    server = IngestServer(path, on_records, lambda reason, n: dropped.update({reason: n}))
    server.start()
    try:
        flood = subprocess.Popen([sys.executable, "-c", SENDER, str(path), "5000", "1", "flood"])
        assert flood.wait(timeout=60) == 0
        job = subprocess.Popen([sys.executable, "-c", SENDER, str(path), "100", "5", "job"])
        assert job.wait(timeout=60) == 0
        wait_for(lambda: sum(dropped.values()) + server._queue.qsize() >= 5100 - 1,
                 what="every datagram queued or refused")
    finally:
        release.set()
        server.stop()
    assert steps[job.pid] == 500
    assert dropped["agent_overloaded"] == 0
    assert steps[flood.pid] <= PRESSURE_DATAGRAMS + PROCESS_SHARE_DATAGRAMS + 1
    assert steps[flood.pid] + dropped["agent_overloaded_process"] == 5000


def test_stop_decodes_what_the_kernel_held_then_refuses_senders(tmp_path: Path) -> None:
    received: list[object] = []
    path = tmp_path / "ingest.sock"
    server = IngestServer(path, lambda records, sender: received.extend(records),
                          lambda reason, n: None)
    for n in range(5):  # queued in the kernel before anyone reads (it holds ~10)
        send(path, [step(n=4 * n + k) for k in range(4)])
    server.start()
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 0.5
    assert [r.step for r in received] == list(range(20))  # type: ignore[attr-defined]
    with pytest.raises(FileNotFoundError):
        send(path, step())


def test_stale_socket_is_replaced_and_a_live_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "ingest.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    stale.close()  # the file stays behind, like after a crash
    live = bind_socket(path)
    try:
        with pytest.raises(IngestError, match="in use by another running agent"):
            bind_socket(path)
    finally:
        live.close()
    regular = tmp_path / "not-a-socket"
    regular.write_text("precious")
    with pytest.raises(IngestError, match="is not a socket"):
        bind_socket(regular)
    assert regular.read_text() == "precious"


def test_unwritable_socket_directory_degrades_but_serves(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    node = Agent(AgentConfig(address="127.0.0.1", port=0, simulate=1,
                             socket=str(blocker / "sub" / "ingest.sock")))
    node.start()
    try:
        url = f"http://127.0.0.1:{node.port}"
        wait_for(lambda: http_get(url + "/readyz")[0] == 200)
        body = json.loads(http_get(url + "/readyz")[1])
        assert body["status"] == "degraded"
        assert any("cannot create socket directory" in p for p in body["problems"])
        assert http_get(url + "/metrics")[0] == 200
    finally:
        node.stop()


def test_every_change_to_a_rank_gives_it_a_version_never_seen_before() -> None:
    from gpumon.wire import EventRecord, HelloRecord, StepRecord

    store = RankStore(ttl_s=10.0)
    versions = []
    for record in (StepRecord(run="r", rank=0, step=0, duration_s=1.0),
                   HelloRecord(run="r", rank=0, local_rank=3),
                   EventRecord(run="r", rank=0, event="oom"),
                   StepRecord(run="r", rank=0, step=1, duration_s=1.0)):
        store.ingest([record], SenderCredentials(pid=7), monotonic=0.0, now_t=0.0)
        versions.append(store.ranks()[0].version)
    assert store.ranks()[0].version == versions[-1]  # reading changes nothing
    store.expire(monotonic=20.0)
    store.ingest([StepRecord(run="r", rank=0, step=0, duration_s=1.0)], SenderCredentials(pid=7),
                 monotonic=20.0, now_t=20.0)  # back as a new state
    versions.append(store.ranks()[0].version)
    assert len(set(versions)) == len(versions)


def test_ttl_expiry_and_rank_cap() -> None:
    from gpumon.wire import StepRecord

    store = RankStore(ttl_s=10.0, max_ranks=2)
    records = [StepRecord(run="r", rank=k, step=0, duration_s=1.0) for k in range(3)]
    accepted = store.ingest(records, SenderCredentials(), monotonic=0.0, now_t=0.0)
    assert [r.rank for r in accepted] == [0, 1]
    assert store.counters()[1] == {"too_many_ranks": 1}
    store.ingest(records[:1], SenderCredentials(), monotonic=8.0, now_t=8.0)
    assert store.expire(monotonic=15.0) == [("r", 1)]  # rank 1 was silent for 15 s
    assert [s.rank for s in store.ranks()] == [0]
    # A freed slot takes a new rank; silent ones are expired to make room.
    assert store.ingest(records[2:], SenderCredentials(), monotonic=30.0, now_t=30.0)
