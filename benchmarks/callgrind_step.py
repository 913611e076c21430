"""What ``gpumon run`` adds to one step of the CPU example, counted by callgrind instead of
timed: instructions and simulated cache misses are the same from run to run, whatever else the
machine does, where the wall clock of this 2-core machine reads ±2 % between blocks.

    python benchmarks/callgrind_step.py KIND STEPS      # KIND: bare, run (gpumon run's hooks) or hand

runs ``examples/train_cpu.py``'s loop (one intra-op thread) for 20 warm-up steps, then STEPS
more, reporting to an in-memory transport, and flushes. Run it under callgrind twice per kind
with two step counts; the difference of the totals over the difference of the steps is one
step's cost, set-up and import cancelled:

    for run in "bare 30" "bare 130" "run 30" "run 80"; do set -- $run
      GPUMON_MEMORY_SAMPLE_S=1000000 OMP_NUM_THREADS=1 valgrind --tool=callgrind --cache-sim=yes \\
        --callgrind-out-file=cg.$1.$2 .venv/bin/python benchmarks/callgrind_step.py $1 $2
    done    # about 10 minutes each; grep '^summary:' cg.*

``GPUMON_MEMORY_SAMPLE_S``: the memory breakdown samples every 5 s of wall time, which under
callgrind (~100x slower) would be every few steps instead of every ~1,500.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from train_cpu import make_job, parse_args, train  # noqa: E402

from gpumon.client import StepMonitor  # noqa: E402
from gpumon.client.autowatch import hooks  # noqa: E402
from gpumon.client.core.transport import MemoryTransport  # noqa: E402

kind, steps = sys.argv[1], int(sys.argv[2])
job = make_job(parse_args(["--threads", "1"]))
mon = None
if kind == "run":
    hooks.make_monitor = lambda: StepMonitor("cg", transport=MemoryTransport(), rank=0, world=1)
    hooks.install()
elif kind == "hand":
    mon = StepMonitor("cg", transport=MemoryTransport(), rank=0, world=1)
    mon.watch(job.model, job.optimizer)
train(job, 20, mon)  # warm: the models learnt, the first sample taken
train(job, steps, mon)
watching = mon or (hooks._state.finder.monitor if hooks._state.finder else None)
if watching is not None:
    watching.flush()
