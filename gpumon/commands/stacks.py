"""``gpumon stacks``: where every rank of a run is, from a running agent's snapshot.

For each rank: whose it is (pod or Slurm job, user, node), its state, the open phase, the
collective in flight (kind, number, bytes, for how long, and on a GPU whether only its kernels
are left), whom it waits on, and its training thread's stack, the job's own frames first
(innermost first), then the rest. ``render`` is pure (tests call it on a snapshot); ``--json``
prints the same as one JSON document.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from gpumon.analysis.stall import STATES
from gpumon.commands.top import fetch_snapshot, owner_text

STACKS_VERSION = 1


def stacks_document(snapshot: Mapping[str, Any], run: str | None = None) -> dict[str, Any]:
    """``{"runs": {run: [rank, ...]}}``: each rank's condition, of ``run`` or of every run."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for rank in snapshot.get("ranks") or []:
        if run is not None and rank.get("run") != run:
            continue
        condition = rank.get("condition") or {"state": "stepping"}
        runs.setdefault(str(rank.get("run")), []).append(
            {"rank": rank.get("rank"), "pid": rank.get("pid"), "steps_total": rank.get("steps_total"),
             "owner": rank.get("owner"), **condition})
    for ranks in runs.values():
        ranks.sort(key=lambda r: r.get("rank") or 0)
    return {"version": STACKS_VERSION, "t": snapshot.get("t"), "runs": runs}


def render(document: Mapping[str, Any], now_unix_s: float | None = None) -> str:
    """The document as text, one block per rank."""
    now = time.time() if now_unix_s is None else now_unix_s
    runs = document.get("runs") or {}
    if not runs:
        return "no ranks reported to this agent\n"
    lines: list[str] = []
    for run, ranks in sorted(runs.items()):
        states = [r.get("state") for r in ranks]
        summary = ", ".join(f"{states.count(s)} {s}" for s in STATES
                            if states.count(s))
        lines.append(f"run {run}: {summary}")
        for rank in ranks:
            lines.extend(_rank_lines(rank, now))
        lines.append("")
    return "\n".join(lines)


def _rank_lines(rank: Mapping[str, Any], now: float) -> list[str]:
    state = rank.get("state")
    whose = owner_text(rank.get("owner"))
    head = (f"  rank {rank.get('rank')} (pid {rank.get('pid') or '?'}"
            f"{', ' + whose if whose else ''}): {state}")
    if state != "stalled":
        return [head + f", {rank.get('steps_total', 0)} steps"]
    stalled = rank.get("stalled_seconds")
    head += f" for {stalled:.0f} s" if isinstance(stalled, (int, float)) else ""
    lines = [head + f", after {rank.get('steps_total', 0)} steps"]
    lines.append(f"    phase: {rank.get('phase') or 'none'}")
    collective = rank.get("collective")
    if collective:
        since = collective.get("since")
        age = f", for {now - since:.0f} s" if isinstance(since, (int, float)) else ""
        where = ", kernels not passed on the GPU" if collective.get("on_device") else ""
        lines.append(f"    in collective: {collective.get('op')} #{collective.get('seq')} "
                     f"({collective.get('bytes')} bytes{age}{where})")
    else:
        launched = rank.get("collectives_launched")
        lines.append("    in collective: none" +
                     (f" ({launched} launched so far)" if launched else ""))
    waits = rank.get("waits_on_label")
    lines.append(f"    waits on: {'rank(s) ' + waits if waits else 'no rank known'}")
    lines.append(f"    at: {rank.get('location')}")
    stack = rank.get("stack") or []
    own = [f for f in stack if f.get("own")]
    rest = [f for f in stack if not f.get("own")]
    if own:
        lines.append("    job frames (innermost first):")
        lines.extend(_frame(f) for f in own)
    if rest:
        lines.append("    other frames (innermost first):")
        lines.extend(_frame(f) for f in rest)
    return lines


def _frame(frame: Mapping[str, Any]) -> str:
    return f"      {frame.get('file')}:{frame.get('line')} in {frame.get('function')}"


def run_stacks(url: str, run: str | None, as_json: bool) -> tuple[int, str]:
    """(exit status, text): 0 and the stacks, 1 and why not when the agent did not answer."""
    try:
        snapshot = fetch_snapshot(url)
    except (OSError, ValueError) as exc:
        return 1, f"gpumon stacks: cannot read {url}: {exc}\n"
    document = stacks_document(snapshot, run)
    if run is not None and not document["runs"]:
        return 1, f"gpumon stacks: no rank of run {run!r} reports to {url}\n"
    return 0, json.dumps(document, indent=2) + "\n" if as_json else render(document)
