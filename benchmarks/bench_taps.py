"""What the communication tap adds per call: the collective tap (``dist.all_reduce``), the
functional collectives' (``funcol.all_reduce`` and the wait on its tensor, as DTensor issues
them) and the point-to-point tap (``isend``/``irecv`` and ``Work.wait``), each against the same
calls in a process without gpumon, in the same session.

Run from the repository root::

    .venv/bin/python benchmarks/bench_taps.py [--calls 20000] [--rounds 5]

Collectives run in a world of one (gloo, in-process); transfers between two ranks under
``torch.distributed.run``, rank 0 sending 4 KiB to rank 1 and waiting. Each round runs every
case once without the tap and once with it (a ledger watching, inside a step), alternating, in
fresh processes; a case's figure is the median over rounds of (with − without) µs per call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT

_CHILD = r"""
import json, os, sys, tempfile, time
import torch, torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

mode, case, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
if case == "p2p":
    dist.init_process_group("gloo")
else:
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/s", rank=0,
                            world_size=1)
ledger = None
if mode == "tap":
    from gpumon.client.comm.ledger import CommLedger
    from gpumon.client.comm.tap import tap_into
    ledger = CommLedger()
    assert tap_into(ledger)
x = torch.ones(1024)
group = dist.group.WORLD
rank = dist.get_rank()

def once():
    if case == "all_reduce":
        dist.all_reduce(x)
    elif case == "functional":
        y = funcol.all_reduce(x, "sum", group)
        y.wait()
    elif rank == 0:
        dist.isend(x, 1).wait()
    else:
        dist.irecv(x, 0).wait()

for _ in range(200):
    once()
fields = {}
if ledger is not None:
    ledger.step_begin()
start = time.perf_counter()
for k in range(calls):
    once()
    if ledger is not None and k % 100 == 99:  # a step every 100 calls, as a real loop's
        ledger.step_end(fields)
        ledger.step_begin()
elapsed = time.perf_counter() - start
if ledger is not None:
    ledger.step_end(fields)
if rank == 0:
    print(json.dumps({"us_per_call": elapsed / calls * 1e6}))
dist.barrier()
dist.destroy_process_group()
"""

CASES = ("all_reduce", "functional", "p2p")


def run(mode: str, case: str, calls: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as child:
        child.write(_CHILD)
    try:
        if case == "p2p":
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-port", str(_free_port()), child.name, mode, case, str(calls)]
        else:
            command = [sys.executable, child.name, mode, case, str(calls)]
        out = subprocess.run(command, capture_output=True, text=True, check=True, env=env,
                             cwd=ROOT, timeout=600).stdout
    finally:
        Path(child.name).unlink()
    line = [text for text in out.splitlines() if text.startswith("{")][-1]
    return float(json.loads(line)["us_per_call"])


def _free_port() -> int:
    from gpumon.testing import free_port

    return free_port()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    added: dict[str, list[float]] = {case: [] for case in CASES}
    bare: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            calls = args.calls // 4 if case == "p2p" else args.calls
            without = run("plain", case, calls)
            with_tap = run("tap", case, calls)
            bare[case].append(without)
            added[case].append(with_tap - without)
    result = {}
    for case in CASES:
        result[case] = {"bare_us": statistics.median(bare[case]),
                        "added_us": statistics.median(added[case]),
                        "added_us_all": [round(a, 2) for a in added[case]]}
        print(f"{case:>11}: {result[case]['bare_us']:8.2f} µs a call bare, "
              f"{result[case]['added_us']:+7.2f} µs with the tap "
              f"(rounds: {result[case]['added_us_all']})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
