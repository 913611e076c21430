"""Agent-side cost of measured communication: the same steps with and without ``comm`` fields.

Run from the repository root::

    .venv/bin/python benchmarks/bench_comm.py [--ranks 64] [--blocks 6]

One process, no sockets: a run of ``--ranks`` ranks (synchronous 0.25 s steps, rank 0 the
straggler) goes through what the agent does with every record — the rank store's counters,
the analyzer (verdicts and, once a pass, the straggler comparison) — and a scrape renders
every family, each pass anew (every rank changed). Blocks alternate between records that
carry a measured ``comm`` field (exposed and busy time, three kinds of collective) and the
same records without it (a hand-timed ``comm`` phase instead, so both compare ranks the same
way); each block is timed with ``process_time``. Prints µs per record ingested and analysed,
ms per scrape, and the ratios of the medians (with / without).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumon.analysis.stream import StepAnalyzer  # noqa: E402
from gpumon.collectors.samples import GpuSample, GpuStatic, SenderCredentials  # noqa: E402
from gpumon.export.exposition import render  # noqa: E402
from gpumon.export.step_metrics import StepFamilies  # noqa: E402
from gpumon.state.ranks import RankStore  # noqa: E402
from gpumon.wire import CollectiveOp, CommStats, StepRecord  # noqa: E402

STEP_S = 0.25
STEPS_PER_PASS = 4  # one agent pass (1 s) per four steps of every rank
GPUS = [GpuStatic(index=i, uuid=f"GPU-{i}", name="NVIDIA H100 80GB HBM3", pci_bus_id="",
                  memory_total_bytes=80 * 1024**3) for i in range(8)]


def records(ranks: int, first: int, measured: bool) -> list[StepRecord]:
    """``STEPS_PER_PASS`` synchronous steps of every rank from step ``first``."""
    out = []
    for n in range(first, first + STEPS_PER_PASS):
        for rank in range(ranks):
            exposed = 0.01 if rank == 0 else 0.08
            phases = {"data": 0.005, "forward": 0.06, "backward": 0.15, "optimizer": 0.02}
            comm = None
            if measured:
                comm = CommStats(exposed, exposed + 0.1, (
                    CollectiveOp("all_reduce", 12, 300 * 2**20, exposed + 0.1),
                    CollectiveOp("all_gather", 2, 2**20, 0.002),
                    CollectiveOp("broadcast", 1, 4096, 0.0005)))
            else:
                phases["comm"] = exposed
            out.append(StepRecord(run="bench", rank=rank, step=n, duration_s=STEP_S,
                                  world=ranks, t_start=1000.0 + n * STEP_S, phases_s=phases,
                                  gpu=f"GPU-{rank % 8}", comm=comm))
    return out


def history(index: int, t0: float, t1: float) -> list[GpuSample]:
    return [GpuSample(index=index, t=t0 + k * 0.25, utilization_ratio=1.0, sm_active_ratio=0.9,
                      tensor_active_ratio=0.6, dram_active_ratio=0.3, sm_clock_hz=1.98e9)
            for k in range(int((t1 - t0) / 0.25) + 1)]


def block(ranks: int, passes: int, measured: bool) -> tuple[float, float]:
    """(µs per record ingested and analysed, ms per scrape) over ``passes`` passes."""
    store, families = RankStore(), StepFamilies()
    analyzer = StepAnalyzer(resolution_s=1.0, ranks=store)
    sender = SenderCredentials()
    batches = [records(ranks, p * STEPS_PER_PASS, measured) for p in range(passes)]
    ingest_s = scrape_s = 0.0
    for p, batch in enumerate(batches):
        now = 1000.0 + (p + 1) * STEPS_PER_PASS * STEP_S + 2.0
        t0 = time.process_time()
        accepted = store.ingest(batch, sender, float(p), now)
        analyzer.add(accepted, now)
        analyzer.process(now, history, GPUS, {})
        t1 = time.process_time()
        render([*families.steps(store.ranks(), *store.counters(), {}, {}),
                *families.analyses(store.ranks())])
        t2 = time.process_time()
        ingest_s += t1 - t0
        scrape_s += t2 - t1
    return ingest_s / (passes * len(batches[0])) * 1e6, scrape_s / passes * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--passes", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=6)
    args = parser.parse_args()
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    block(args.ranks, 4, True)  # warm-up: imports, caches
    for b in range(args.blocks):
        for measured in ((True, False) if b % 2 == 0 else (False, True)):
            results[measured].append(block(args.ranks, args.passes, measured))
    rows = {}
    for measured, found in results.items():
        rows[measured] = (statistics.median(r[0] for r in found),
                          statistics.median(r[1] for r in found))
        label = "with comm field" if measured else "comm phase only"
        print(f"{label:16}  {rows[measured][0]:7.1f} µs/record  {rows[measured][1]:6.2f} ms/scrape"
              f"  ({args.ranks} ranks, {args.blocks} blocks of {args.passes} passes)")
    print(f"ratio (with / without): record {rows[True][0] / rows[False][0]:.2f}, "
          f"scrape {rows[True][1] / rows[False][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
