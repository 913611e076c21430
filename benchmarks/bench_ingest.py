"""Ingest throughput: records/s a real agent sustains with zero drops, and the drop curve.

    .venv/bin/python benchmarks/bench_ingest.py [--seconds 3] [--rates 10000,25000,50000,...]

A sender process pre-encodes batched step datagrams as the client hook sends them (a JSON
array of records per datagram, ≤ 8 KiB) and paces them at each offered rate for a few
seconds; a record is lost when the send fails (the agent's receive queue is full) or the
agent drops it. Baseline in the same run: a bare Python receiver that only reads datagrams
from the same kind of socket (the ceiling of any Python ingest on this machine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import tempfile
import time
from pathlib import Path

from common import step_record

from gpumon.testing import agent_env, parse_metrics, start_agent, values
from gpumon.wire import encode_datagrams

RANKS = 8
RETRY_BUDGET_S = 0.05  # what the client's sender allows a full queue per flush


def datagrams(count: int) -> list[bytes]:
    """Realistic step records from 8 ranks, packed as the client packs them."""
    now = time.time()
    return encode_datagrams([step_record("bench", i % RANKS, i // RANKS, now + i * 1e-3, 0.35)
                             for i in range(count)])


def _send(path: str, rate: float, seconds: float, queue: mp.Queue) -> None:
    """Pace pre-encoded datagrams at ``rate`` records/s. Like the client's sender thread, a
    full socket queue is retried for up to RETRY_BUDGET_S before the datagram is lost."""
    batch = datagrams(2000)
    per = [len(json.loads(d)) for d in batch]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sent = failed = 0
    start = time.perf_counter()
    i = 0
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
        if sent + failed > rate * elapsed:  # pace: ahead of schedule, wait a little
            time.sleep(0.0005)
            continue
        k = i % len(batch)
        deadline = time.perf_counter() + RETRY_BUDGET_S
        while True:
            try:
                sock.sendto(batch[k], path)
                sent += per[k]
                break
            except BlockingIOError:
                if time.perf_counter() >= deadline:
                    failed += per[k]
                    break
                time.sleep(0.0002)
            except OSError:
                failed += per[k]
                break
        i += 1
    queue.put((sent, failed, time.perf_counter() - start))


def offer(path: str, rate: float, seconds: float) -> tuple[int, int, float]:
    queue: mp.Queue = mp.Queue()
    sender = mp.Process(target=_send, args=(path, rate, seconds, queue))
    sender.start()
    result = queue.get()
    sender.join()
    return result


def _bare_receiver(path: str, ready: mp.Event, stop: mp.Event, queue: mp.Queue) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * 1024 * 1024)
    sock.bind(path)
    sock.settimeout(0.2)
    ready.set()
    records = 0
    while not stop.is_set():
        try:
            data = sock.recv(8193)
        except TimeoutError:
            continue
        records += len(json.loads(data))
    queue.put(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rates", default="10000,25000,50000,75000,100000,150000,200000")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        agent = start_agent(Path(tmp), "--simulate", "1", "--interval", "1", env=agent_env())
        try:

            def received() -> float:
                m = parse_metrics(agent.scrape())
                return sum(values(m, "gpumon_ingest_records_total", kind="step"))

            def dropped() -> float:
                return sum(values(parse_metrics(agent.scrape()), "gpumon_ingest_dropped_total"))

            for rate in rates:
                r0, d0 = received(), dropped()
                sent, failed, elapsed = offer(str(agent.socket_path), rate, args.seconds)
                time.sleep(1.0)  # let the agent drain its queue
                got = received() - r0
                lost = failed + (sent - got) + (dropped() - d0)
                rows.append(
                    {
                        "offered_per_s": rate,
                        "achieved_per_s": (sent + failed) / elapsed,
                        "accepted_per_s": got / elapsed,
                        "lost": int(lost),
                        "lost_ratio": lost / max(1, sent + failed),
                    }
                )
        finally:
            agent.stop()
        # Baseline: a receiver that only reads and parses the JSON array.
        path = str(Path(tmp) / "bare.sock")
        ready, stop, queue = mp.Event(), mp.Event(), mp.Queue()
        receiver = mp.Process(target=_bare_receiver, args=(path, ready, stop, queue))
        receiver.start()
        ready.wait(10)
        bare_rate = max(rates)
        sent, failed, elapsed = offer(path, bare_rate, args.seconds)
        time.sleep(1.0)
        stop.set()
        bare_received = queue.get()
        receiver.join()
    sustained = max((r["accepted_per_s"] for r in rows if r["lost"] == 0), default=0.0)
    offered = max((r["offered_per_s"] for r in rows if r["lost"] == 0), default=0.0)
    print(f"{'offered/s':>10} {'achieved/s':>11} {'accepted/s':>11} {'lost':>8} {'lost %':>7}")
    for r in rows:
        print(
            f"{r['offered_per_s']:>10.0f} {r['achieved_per_s']:>11.0f} "
            f"{r['accepted_per_s']:>11.0f} {r['lost']:>8d} {100 * r['lost_ratio']:>6.2f}%"
        )
    print(f"highest rate offered with zero loss: {offered:.0f} records/s "
          f"({sustained:.0f}/s achieved by the paced sender)")
    print(
        f"bare Python receiver (read + json.loads only) at {bare_rate:.0f}/s offered: "
        f"{bare_received / elapsed:.0f} records/s accepted, {failed} failed sends"
    )
    print(
        json.dumps(
            {
                "rows": rows,
                "sustained_zero_loss_per_s": sustained,
                "offered_zero_loss_per_s": offered,
                "bare_receiver_per_s": bare_received / elapsed,
            }
        )
    )


if __name__ == "__main__":
    main()
