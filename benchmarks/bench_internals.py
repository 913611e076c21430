"""The figures behind two of the agent's internal constants, measured in-process.

Run from the repository root::

    .venv/bin/python benchmarks/bench_internals.py [--repeats 5]

1. The verdict engine's slice units (``analysis.stream.VERDICT_WORK``, ``SLICE_WORK``): the
   cost of one verdict against the cost of grouping and merging one step, on windows of ten
   0.1 s steps of one rank with GPM samples. ``steps_per_verdict`` is the ``VERDICT_WORK``
   that would make the units equal; ``slice_ms`` how long a slice of ``SLICE_WORK`` units of
   such windows lasts.
2. ``gc.freeze()`` after the agent starts: a full collection in a process that imported the
   agent and the CLI, before and after freezing what exists by then.

Each figure is the median of ``--repeats`` runs; a ratio is taken within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from common import ROOT

from gpumon.analysis.stream import SLICE_WORK, VERDICT_WORK, StepAnalyzer
from gpumon.analysis.window import group_steps, merge_steps
from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.wire import StepRecord

H100 = GpuStatic(index=0, uuid="GPU-a", name="NVIDIA H100 80GB HBM3", pci_bus_id="",
                 memory_total_bytes=80 * 1024**3)
SAMPLES = [GpuSample(index=0, t=k * 0.25, utilization_ratio=0.95, sm_active_ratio=0.93,
                     tensor_active_ratio=0.7, dram_active_ratio=0.3) for k in range(4 * 4000)]


def _history(index: int, t0: float, t1: float) -> list[GpuSample]:
    return SAMPLES[max(0, int(t0 * 4)): int(t1 * 4) + 1]


def _steps(count: int) -> list[StepRecord]:
    return [StepRecord(run="r", rank=0, step=n, duration_s=0.1, t_start=1.0 + n * 0.1,
                       gpu="GPU-a", phases_s={"data": 0.002, "forward": 0.04, "backward": 0.05})
            for n in range(count)]


def verdict_cost(steps: int = 4_000) -> dict[str, float]:
    """Milliseconds per verdict (a pass over windows of ten steps; fewer steps than a rank may
    hold waiting, ``MAX_PENDING``) and microseconds per step
    grouped and merged into its window, the two units of a slice."""
    records = _steps(steps)
    analyzer = StepAnalyzer(resolution_s=1.0)
    analyzer.add(records, received_t=records[-1].t_end or 0.0)
    start = time.perf_counter()
    verdicts = analyzer.process(4000.0, _history, [H100], {})
    pass_s = time.perf_counter() - start
    start = time.perf_counter()
    for members in group_steps(records, 1.0):
        merge_steps(members, None)
    step_s = time.perf_counter() - start
    per_step = step_s / steps
    per_verdict = (pass_s - step_s) / len(verdicts)
    return {"verdict_ms": per_verdict * 1e3, "step_us": per_step * 1e6,
            "steps_per_verdict": per_verdict / per_step,
            "slice_ms": SLICE_WORK / (VERDICT_WORK + 10) * (per_verdict + 10 * per_step) * 1e3}


_GC_CHILD = """
import gc, json, time
import gpumon.agent.lifecycle, gpumon.cli  # what the agent has imported once it serves
def full():
    start = time.perf_counter(); gc.collect(); return time.perf_counter() - start
full()
before = [full() for _ in range(5)]
tracked = len(gc.get_objects())
gc.freeze()
after = [full() for _ in range(5)]
print(json.dumps({"objects": tracked, "before_ms": min(before) * 1e3,
                  "after_ms": min(after) * 1e3}))
"""


def gc_cost() -> dict[str, float]:
    """A full collection's time in a fresh process that imported the agent, before and after
    ``gc.freeze()``."""
    out = subprocess.run([sys.executable, "-c", _GC_CHILD], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    result: dict[str, float] = json.loads(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    verdicts = [verdict_cost() for _ in range(args.repeats)]
    gcs = [gc_cost() for _ in range(args.repeats)]
    result = {name: statistics.median(v[name] for v in verdicts)
              for name in ("verdict_ms", "step_us", "steps_per_verdict", "slice_ms")}
    result |= {f"gc_{name}": statistics.median(g[name] for g in gcs)
               for name in ("objects", "before_ms", "after_ms")}
    print(f"VERDICT_WORK = {VERDICT_WORK}, SLICE_WORK = {SLICE_WORK}")
    for name, value in result.items():
        print(f"{name:>18}: {value:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
