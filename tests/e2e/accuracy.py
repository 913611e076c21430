"""Accuracy bounds on real jobs, and the products they must tell from the real one.

A bound compares what gpumon recorded of a job's steps with what the job measured of itself
(``jobs/ddp_job.py``: its clocks per step, a delay it added on purpose, the bytes it holds).
It is only worth its place if it fails for a product that measures communication wrongly, so
every test applies its bounds to the recorded steps as they are and to the same steps
transformed as four broken products would have reported them:

- **N** reports no communication (``exposed`` and ``busy`` 0);
- **A** reports all of the step as communication (both the step's duration);
- **B** does not subtract the overlap (``exposed`` = ``busy``);
- **U** reads 30 % low (both times 0.7).

The transformation is done here, on the recorded values: nothing in the product can switch
into a broken mode. Each bound says which products it fails; the test asserts exactly that,
and that the real product passes every bound.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumon.commands.classify import classify_file

Row = dict[str, Any]
"""One reported step: the recorded ``exposed``, ``busy`` and ``duration``, the job's own
clocks over the part of it where collectives run (``backward``: wall, CPU time, run delay,
steal, slept in device-like work), its ``kind``, ``rank`` and, if it was held late, how
late (``late``)."""

PRODUCTS: dict[str, Callable[[Row], Row]] = {
    "N": lambda r: {**r, "exposed": 0.0, "busy": 0.0},
    "A": lambda r: {**r, "exposed": r["duration"], "busy": r["duration"]},
    "B": lambda r: {**r, "exposed": r["busy"]},
    "U": lambda r: {**r, "exposed": 0.7 * r["exposed"], "busy": 0.7 * r["busy"]},
}
"""The broken products, as transformations of what the real one recorded."""

SLACK_S = 0.002
"""What a step's exposed time may hold beyond the training thread's waits, and what else its
waits may hold, per step: the hook's own work on the thread (launching, dividing a small
bucket), the wake-up after the wait, the GIL taken by the client's sender thread."""


@dataclass(frozen=True)
class Bound:
    """A check on a job's steps (all ranks): ``read`` returns the figure it judges and
    whether it holds."""

    name: str
    read: Callable[[list[Row]], tuple[bool, str]]
    fails: str
    """The broken products it fails, by letter (stated in the test that uses it)."""
    either: str = ""
    """Broken products that read within a hair of the truth here, so may pass or fail (the
    test says why); every other one must pass."""


def rows_of(job: Any, rank: int) -> list[Row]:
    """The recorded steps of ``rank`` beside the job's own clocks for each: the window its
    collectives run in (``backward``: DDP's backward; a framework job's ``window_s``)."""
    steps, summary = job.steps(rank), job.summary(rank)
    windows = summary.get("backward_s") or summary["window_s"]
    assert len(steps) == len(windows), (len(steps), len(windows))
    rows = []
    for i, step in enumerate(steps):
        comm = step.get("comm", {"exposed": 0.0, "busy": 0.0, "ops": {}})
        rows.append({"rank": rank, "line": step, "exposed": comm["exposed"], "busy": comm["busy"],
                     "duration": step["duration"], "ops": comm.get("ops", {}),
                     "backward": windows[i], "kind": summary.get("kinds", ["sync"] * len(steps))[i],
                     "late": summary.get("late_s", [0.0] * len(steps))[i]})
    return rows


def waited(row: Row) -> tuple[float, float]:
    """What the job's clocks allow the step's exposed time to be.

    Off a CPU and not runnable, less the device-like sleeps, the training thread waited for
    its collectives: at least that is exposed. Time it spent runnable without a CPU (run
    delay, steal) may be exposed too, as contention with the collectives' threads; time it
    spent on a CPU or asleep in device-like work is not. All of it in backward, the only
    phase DDP's collectives run in. Where a job timed the CPU spent inside blocking
    collective calls (copies into their buffers), that too is communication. So, of
    backward's clocks::

        wall - cpu - wait - steal - slept  <=  exposed  <=  wall - cpu - slept + in calls
    """
    wall_s, cpu_s, wait_s, steal_s, slept_s, *in_calls = row["backward"]
    off = wall_s - cpu_s - slept_s
    return off - wait_s - steal_s - SLACK_S, off + sum(in_calls) + SLACK_S


def within_backward(row: Row) -> tuple[float, float]:
    """``waited`` for a job whose training thread does communication's own work on its CPU
    in backward, beside the compute: the lower side as there, the upper side backward's whole
    wall time less the device-like sleeps (and the calls timed).

    DDP scales each gradient for the average on the training thread (as it copies it into
    its bucket, or in place with bucket views), and without bucket views copies the buckets
    back into the gradients: communication, as the job's ``no_sync`` steps show (they skip it
    all), but CPU time the job's clocks cannot tell from backward's compute. On a quiet
    machine the tighter upper side of ``waited`` read 4-15 ms a step under what these jobs
    expose; a pass timed by the job on a buffer as large as the gradients explained about two
    thirds of it. So these jobs hold the exposed
    time to backward's wall: what fails is a product that counts more than backward (A), or
    nothing at all (N)."""
    wall_s, cpu_s, wait_s, steal_s, slept_s, *in_calls = row["backward"]
    low, _ = waited(row)
    return low, wall_s - slept_s + sum(in_calls) + SLACK_S


def within_clocks(kinds: tuple[str, ...] = ("sync", "sync-late"), *,
                  cpu_in_comm: bool = False) -> Callable[[list[Row]], tuple[bool, str]]:
    """Each rank's exposed time, summed over its steps of ``kinds``, within the sums of what
    its clocks allow (``waited``; ``within_backward`` with ``cpu_in_comm``)."""
    allowed = within_backward if cpu_in_comm else waited

    def read(rows: list[Row]) -> tuple[bool, str]:
        ok, parts = True, []
        for rank in sorted({r["rank"] for r in rows}):
            mine = [r for r in rows if r["rank"] == rank and r["kind"] in kinds]
            low = sum(allowed(r)[0] for r in mine)
            high = sum(allowed(r)[1] for r in mine)
            got = sum(r["exposed"] for r in mine)
            ok = ok and low <= got <= high
            parts.append(f"rank {rank}: {1e3 * got / len(mine):.1f} ms in "
                         f"[{1e3 * low / len(mine):.1f}, {1e3 * high / len(mine):.1f}] a step")
        return ok, "; ".join(parts)
    return read


def rise_by_the_delay(tolerance_s: float) -> Callable[[list[Row]], tuple[bool, str]]:
    """Each rank's exposed time on a step whose buckets completed late, less the step before
    it (the same step, on time), less how late the job measured the futures completing (the
    delay asked for, and however long the timer's thread then waited for a CPU): the median
    of those within ``tolerance_s`` of 0."""
    def read(rows: list[Row]) -> tuple[bool, str]:
        ok, parts = True, []
        for rank in sorted({r["rank"] for r in rows}):
            mine = [r for r in rows if r["rank"] == rank]
            pairs = [(late["exposed"] - on_time["exposed"], late["late"])
                     for on_time, late in zip(mine, mine[1:], strict=False)
                     if on_time["kind"] == "sync" and late["kind"] == "sync-late"]
            error = statistics.median(rise - late for rise, late in pairs)
            ok = ok and abs(error) <= tolerance_s
            parts.append(f"rank {rank}: +{1e3 * statistics.median(r for r, _ in pairs):.1f} ms for "
                         f"{1e3 * statistics.median(d for _, d in pairs):.1f} ms late "
                         f"({1e3 * error:+.1f})")
        return ok, "; ".join(parts)
    return read


def at_most(kind: str, limit_s: float) -> Callable[[list[Row]], tuple[bool, str]]:
    """Every step of ``kind`` exposed for at most ``limit_s``."""
    def read(rows: list[Row]) -> tuple[bool, str]:
        most = max(r["exposed"] for r in rows if r["kind"] == kind)
        return most <= limit_s, f"at most {1e3 * most:.1f} ms"
    return read


def verdict_share(recording: Path, primary: str, low: float, high: float,
                  ) -> Callable[[list[Row]], tuple[bool, str]]:
    """Each rank's share of verdicts with ``primary`` as the bottleneck within [low, high]:
    the verdict engine (``gpumon classify``) run on the recording with the steps as ``rows``
    hold them, after each rank's first window (the ranks start out of step)."""
    def read(rows: list[Row]) -> tuple[bool, str]:
        steps = {(r["rank"], r["line"]["step"]): r for r in rows}
        lines = []
        for line in recording.read_text().splitlines():
            record = json.loads(line) if line.strip() else None
            row = steps.get((record.get("rank"), record.get("step"))) if record and \
                record.get("kind") == "step" and record.get("run") == rows[0]["line"]["run"] else None
            if row is not None and "comm" in record:
                record = {**record, "comm": {**record["comm"], "exposed": row["exposed"],
                                             "busy": row["busy"]}}
            if record is not None:
                lines.append(json.dumps(record))
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / "recording.jsonl"
            path.write_text("\n".join(lines) + "\n")
            _, verdicts = classify_file(path)
        ok, parts = True, []
        for rank in sorted({r["rank"] for r in rows}):
            mine = [v for v in verdicts if v.run == rows[0]["line"]["run"] and v.rank == rank]
            steps_judged = [v.verdict for v in mine[1:] for _ in v.steps]
            share = sum(v.primary.value == primary for v in steps_judged) / len(steps_judged)
            ok = ok and low <= share <= high
            parts.append(f"rank {rank}: {share:.0%} {primary}")
        return ok, "; ".join(parts)
    return read


def judged(bounds: list[Bound], rows: list[Row]) -> str:
    """Assert the real product passes every bound and each bound fails exactly the broken
    products it names; the table of what each read, for the test's output."""
    table, wrong = [], []
    for bound in bounds:
        for product, transform in {"real": lambda r: r, **PRODUCTS}.items():
            ok, reading = bound.read([transform(r) for r in rows])
            should_fail = product in bound.fails
            table.append(f"{bound.name:<28} {product:<5} {'fails' if not ok else 'holds'}  {reading}")
            if ok == should_fail and product not in bound.either:
                wrong.append(table[-1])
    text = "\n".join(table)
    print(text)
    assert not wrong, "\n".join(["bounds judged wrongly:", *wrong, "", text])
    return text
