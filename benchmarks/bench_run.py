"""What ``gpumon run`` costs a job that knows nothing of gpumon: throughput with and without it.

    python benchmarks/bench_run.py [--processes 8] [--blocks 41] [--block-steps 40] [--cpu-pairs 4]
                                   [--turns 60] [--one-core] [--ddp-rounds 30] [--ddp-block-steps 3]
                                   [--ddp-pairs 5] [--ddp-steps 12]

``--blocks 0`` or ``--cpu-pairs 0`` leaves a CPU part out, ``--ddp-rounds 0`` or ``--ddp-pairs 0``
a DDP part.

- ``cpu``: ``examples/train_cpu.py``'s loop (the MLP on in-memory data, one intra-op thread)
  in one process, in blocks of ``--block-steps`` steps, rotating between bare (the example's
  ``--no-hook`` loop, which calls nothing of gpumon), that same loop with ``gpumon run``'s
  hooks in torch (``gpumon.client.autowatch.hooks.install()``, what its ``sitecustomize``
  does; taken out again after the block), the loop hooked by hand (``StepMonitor``,
  ``watch(model, optimizer)``) and bare again (the control), all reporting to a real Unix
  datagram socket drained by a reader process. Every arm trains the same model on the same
  tensors. Each block starts with ``WARM_STEPS`` untimed steps of its kind (after the hooks go
  in or come out, Python re-specialises the call sites that depend on the model's class: once
  in a job, once a block here, a cost this method charges to gpumon). The training thread has
  a core of its own; gpumon's thread and the reader run on the other (a GPU node has cores to
  spare; what gpumon must not take is the training thread's time), and a watched block's
  records are sent when its clock has stopped, before the next block (gpumon's thread may also
  send some while the block runs, every ``FLUSH_INTERVAL_S``, as in a job). ``--one-core`` puts
  them all on the training thread's core, and times the sending of a block's records with it
  (on the training thread: the worst case, a job with one core). A process's figures are
  medians over rounds: the throughput ratio to bare, and the training thread's CPU time added
  per step. This runs in
  ``--processes`` fresh processes, one after another: where a process's tensors and gpumon's
  objects fall in memory is drawn anew in each, and that draw alone moves one arm against
  another by up to ~1 % for a whole process (the control's spread shows it). The figures are
  the means over processes. ``tiny`` runs the same loop on a model of 8 units and a batch of
  8, 10 times the steps a block, where the loop's own Python is most of the step and what the
  hooks add shows.
- ``tiny_turns``: the tiny loop in two worker processes at a time that take turns running a
  block of 10 × ``--block-steps`` steps, ``--turns`` each, the order flipping every round. In
  a ``run`` pair, one worker is started bare and the other under the real ``gpumon run``
  command; in a ``control`` pair both are bare: what two processes of the same job read apart
  here. Each worker's training thread is pinned to a core of its own (swapped from one pair of
  a kind to the next), and is in its steady state before its first timed turn
  (``WORKER_WARM_STEPS``); nothing goes in or out of a process between turns. ``--cpu-pairs``
  of each kind, interleaved; the figures are medians over a kind's pairs of the medians over
  rounds. (On the example's 3 ms matrix products, two processes read several per cent apart
  from where their tensors fell alone: there, turns measure the draw, not gpumon.)
- ``ddp``: the communication-heavy 2-rank DDP job (4 × Linear(2048, 2048), batch 2, gloo),
  under ``torch.distributed.run``, two ways:

  - in one process per rank, each pinned to a core (``--ddp-rounds``): blocks of
    ``--ddp-block-steps`` steps rotating between one DDP model trained plain, the same model
    with ``gpumon run``'s hooks in torch (installed for those blocks only), and a second,
    identical model trained plain: the control, whose ratio to the first is what this machine
    reads between two model objects that should run alike. The watched model keeps the hooks
    its watch put on its gradients in its plain blocks, where they return at their first test
    (~1 µs a gradient). Medians over rounds of each one's throughput against the plain blocks,
    on rank 0 (the ranks step together);
  - as whole launches (``--ddp-pairs``), started plain and under ``gpumon run``, the order
    flipping every pair. Each rank times its steps after a warm-up; the figure is the median
    over pairs of the ratio of the ranks' median step times. Separate launches read ±10 %
    apart on a shared machine.

Prints a line per round or pair and a JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
T = TypeVar("T")
WARM_STEPS = 5
"""Untimed steps at the start of every in-process CPU block (see ``cpu_blocks``)."""
STEADY_MALLOC = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1073741824:"
                                   "glibc.malloc.mmap_threshold=1073741824"}
"""The CPU parts' processes keep the memory glibc's allocator has: the example's step frees and
allocates buffers of 128 KiB and more, and by default glibc hands memory back to the kernel and
faults it in again at a rate that its own heuristics set from the process's allocation history:
0 to 500 page faults a step, up to 0.4 ms of kernel time on a 2.7 ms step, changing from block
to block and from process to process. That would be what the arms' ratios read. With fixed
thresholds (what a job gets from tcmalloc or jemalloc, or these settings) the step faults no
page once warm, and what is left is the loop's own work. ``--default-malloc`` leaves glibc's
defaults."""
WORKER_WARM_STEPS = 50
"""Steps a CPU worker runs before its first timed turn: under ``gpumon run``, the models are
learnt (``LEARN_STEPS``) and the module-call wrap narrowed by then, and the first memory
sample taken; the job is in its steady state."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=41)
    parser.add_argument("--processes", type=int, default=8, help="fresh processes the CPU blocks run in")
    parser.add_argument("--block-steps", type=int, default=40)
    parser.add_argument("--cpu-pairs", type=int, default=4)
    parser.add_argument("--turns", type=int, default=60, help="timed turns of each process of a CPU pair")
    parser.add_argument("--ddp-rounds", type=int, default=30)
    parser.add_argument("--ddp-block-steps", type=int, default=3)
    parser.add_argument("--ddp-pairs", type=int, default=5)
    parser.add_argument("--ddp-steps", type=int, default=12)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--blocks-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu-worker", type=int, metavar="CORE", help=argparse.SUPPRESS)
    parser.add_argument("--blocks-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", default="", help=argparse.SUPPRESS)
    parser.add_argument("--default-malloc", action="store_true",
                        help="glibc's allocator as it comes, in the CPU parts (see STEADY_MALLOC)")
    parser.add_argument("--one-core", action="store_true",
                        help="the CPU parts' processes wholly on the training thread's core, "
                             "gpumon's thread too")
    args = parser.parse_args()
    if args.cpu_worker is not None:
        cpu_worker(args.cpu_worker, args.job, args.one_core)
        return
    if args.blocks_process:
        figures = cpu_blocks(args.blocks, args.block_steps, tuple(args.job.split()), args.one_core)
        print(json.dumps(figures))
        return
    if args.worker:
        ddp_worker(args.ddp_steps)
        return
    if args.blocks_worker:
        ddp_blocks_worker(args.ddp_rounds, args.ddp_block_steps)
        return
    # A model so small that the step is mostly the loop's own Python: what the hooks add shows.
    small = ("--hidden", "8", "--batch-size", "8")
    cpu = tiny = tiny_in_turns = None
    if args.blocks and args.processes:
        malloc = {} if args.default_malloc else STEADY_MALLOC
        cpu = cpu_processes(args.processes, args.blocks, args.block_steps, (), args.one_core, malloc)
        tiny = cpu_processes(args.processes, args.blocks, args.block_steps * 10, small, args.one_core, malloc)
    if args.cpu_pairs and args.turns:
        tiny_in_turns = cpu_turns(args.cpu_pairs, args.turns, args.block_steps * 10, small, args.one_core,
                                  {} if args.default_malloc else STEADY_MALLOC)
    in_process = ddp_blocks(args.ddp_rounds, args.ddp_block_steps) if args.ddp_rounds else None
    ddp = ddp_pairs(args.ddp_pairs, args.ddp_steps) if args.ddp_pairs else None
    print(json.dumps({"bench": "run", "cpu": cpu, "tiny": tiny, "tiny_turns": tiny_in_turns,
                      "ddp_in_process": in_process, "ddp_throughput_ratio": ddp, "processes": args.processes,
                      "blocks": args.blocks, "block_steps": args.block_steps,
                      "cpu_pairs": args.cpu_pairs, "turns": args.turns, "ddp_rounds": args.ddp_rounds,
                      "ddp_block_steps": args.ddp_block_steps, "ddp_pairs": args.ddp_pairs,
                      "ddp_steps": args.ddp_steps}))


def cpu_processes(processes: int, blocks: int, block_steps: int, extra: tuple[str, ...],
                  one_core: bool, malloc: dict[str, str]) -> dict[str, Any]:
    """``cpu_blocks`` in ``processes`` fresh processes, one after another. Where a process's
    tensors and gpumon's objects fall in memory is drawn anew in each (address-space layout
    randomisation), and on this machine it moves one arm against another by up to ~1 % for a
    whole run; each process's medians carry that draw. The figures: the mean over processes of
    each one's medians (the draws averaged out), with each process's figure."""
    command = [sys.executable, __file__, "--blocks-process", "--blocks", str(blocks), "--block-steps",
               str(block_steps), "--job", " ".join(extra), *(["--one-core"] if one_core else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **malloc}
    runs = []
    for i in range(processes):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"a CPU blocks process failed:\n{done.stdout}\n{done.stderr[-6000:]}")
        runs.append(json.loads(done.stdout.splitlines()[-1]))
        print(f"  process {i}: gpumon run {runs[-1]['run']:.4f} ({runs[-1]['run_added_us']:+.1f} µs), "
              f"by hand {runs[-1]['hooked']:.4f} ({runs[-1]['hooked_added_us']:+.1f} µs), "
              f"bare again {runs[-1]['again']:.4f} ({runs[-1]['again_added_us']:+.1f} µs)")
    figures: dict[str, Any] = {key: statistics.fmean(run[key] for run in runs) for key in runs[0]}
    for kind in ("run", "hooked", "again"):
        figures[f"{kind}_processes"] = [run[kind] for run in runs]
    print(f"cpu {' '.join(extra) or 'example'}: {processes} processes of {blocks} rounds of "
          f"{block_steps}-step blocks ({figures['bare_ms']:.2f} ms of CPU a bare step), "
          "means over processes:")
    for kind, name in (("run", "gpumon run"), ("hooked", "hooked by hand"), ("again", "bare again")):
        values = figures[f"{kind}_processes"]
        print(f"  {name:15s} throughput / bare {figures[kind]:.4f} (processes {min(values):.4f} .. "
              f"{max(values):.4f}, standard error {standard_error(values):.4f}); "
              f"training thread's CPU {figures[kind + '_added_us']:+.1f} µs a step")
    return figures


def standard_error(values: list[float]) -> float:
    """Of the mean of ``values`` (0 for fewer than two)."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def cpu_blocks(blocks: int, block_steps: int, extra: tuple[str, ...] = (), one_core: bool = False,
               ) -> dict[str, float]:
    """Rounds of four blocks of ``examples/train_cpu.py``'s loop, in rotating order: bare (its
    ``--no-hook`` loop, which calls nothing of gpumon), with ``gpumon run``'s hooks in torch
    around that same loop, hooked by hand (``StepMonitor`` and ``watch(model, optimizer)``), and
    bare again (the control: what this machine reads between two blocks of the same loop).
    Medians over rounds of each one's throughput and training-thread CPU against bare."""
    from bench_hook import drained_socket
    from train_cpu import make_job, parse_args, train

    from gpumon.client import StepMonitor
    from gpumon.client.autowatch import hooks

    with drained_socket() as (socket_path, finish), pinned(everything=one_core) as pin_training_thread:
        hooks.make_monitor = lambda: StepMonitor("bench-run", socket_path=socket_path)
        # The hand-hooked arm's monitor lives in this process too: gpumon run's hooks would take
        # it for the job's own and stand down. Here they are told of no other monitor.
        hooks._others = lambda: 0
        job = make_job(parse_args(["--threads", "1", *extra]))
        by_hand = StepMonitor("bench-run-hooked", socket_path=socket_path)
        by_hand.watch(job.model, job.optimizer)

        def seconds(kind: str) -> tuple[float, float]:
            if kind == "run":
                hooks.install()
            # A few untimed steps first, in every kind: putting the hooks in and taking them out
            # changes the model's class, and Python then re-specialises the call sites that
            # depend on it over the next steps (a job pays that once; this loop every block).
            train(job, WARM_STEPS, by_hand if kind == "hooked" else None)
            flush(kind)
            c0, t0 = time.thread_time(), time.perf_counter()
            train(job, block_steps, by_hand if kind == "hooked" else None)
            if one_core:
                flush(kind)
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            flush(kind)  # (where a watched block's records are sent: in it, not in the next)
            if kind == "run":
                hooks.take_out()
            return wall, cpu

        def flush(kind: str) -> None:
            if kind == "run":
                finder = hooks._state.finder
                if finder is not None:
                    finder.monitor.flush()
            elif kind == "hooked":
                by_hand.flush()

        kinds = ["bare", "run", "hooked", "again"]
        for kind in kinds:  # warm every path up (the watch starts on the first watched step)
            seconds(kind)
        pin_training_thread()  # (the monitors' threads, started by now, stay off its core)
        ratios: dict[str, list[float]] = {f"{kind}{figure}": [] for kind in kinds[1:]
                                          for figure in ("", "_cpu", "_added_us")}
        ratios["bare_ms"] = []
        for result in rotated(blocks, kinds, seconds):
            for kind in kinds[1:]:
                ratios[kind].append(result["bare"][0] / result[kind][0])
                ratios[f"{kind}_cpu"].append(result["bare"][1] / result[kind][1])
                ratios[f"{kind}_added_us"].append((result[kind][1] - result["bare"][1]) / block_steps * 1e6)
            ratios["bare_ms"].append(result["bare"][1] / block_steps * 1e3)
        steps = uninstall(hooks)
        by_hand.close()
        received = finish()
    figures = {key: statistics.median(values) for key, values in ratios.items()}
    print(f"cpu {' '.join(extra) or 'example'}: {blocks} rounds of {block_steps}-step blocks "
          f"({figures['bare_ms']:.2f} ms of CPU a bare step), {steps} steps through gpumon run's "
          f"hooks, {received} records received")
    for kind, name in (("run", "gpumon run"), ("hooked", "hooked by hand"), ("again", "bare again")):
        low, _, high = statistics.quantiles(ratios[kind], n=4)
        print(f"  {name:15s} throughput / bare {figures[kind]:.4f} (quartiles {low:.4f} .. {high:.4f}); "
              f"training thread's CPU bare / it {figures[kind + '_cpu']:.4f}, "
              f"{figures[kind + '_added_us']:+.1f} µs a step")
    return figures


def cpu_turns(pairs: int, rounds: int, block_steps: int, extra: tuple[str, ...], one_core: bool,
              malloc: dict[str, str]) -> dict[str, Any]:
    """``examples/train_cpu.py``'s loop in two processes at a time that take turns running blocks
    of ``block_steps`` steps, ``rounds`` each, the order flipping every round. A pair is either
    a bare process and one started under ``gpumon run`` (``run``), or two bare ones (``control``,
    the floor: what two processes of the same job read apart here). ``pairs`` of each kind,
    interleaved (run, control, control, run, ...); the two processes of a pair are pinned to a
    core each, swapped from one pair of a kind to the next. The figures: the median over a
    kind's pairs of the median over rounds of bare ÷ other, the throughput and the training
    thread's CPU, and the training thread's CPU added a step."""
    from bench_hook import drained_socket

    per_pair: dict[str, list[dict[str, float]]] = {"run": [], "control": []}
    with drained_socket() as (socket_path, finish):
        for pair in range(2 * pairs):
            kind = ("run", "control")[(pair + 1) // 2 % 2]
            cores = (0, 1) if len(per_pair[kind]) % 2 == 0 else (1, 0)
            figures = turns(socket_path, kind == "run", cores, rounds, block_steps, extra, one_core, malloc)
            per_pair[kind].append(figures)
            print(f"  pair {pair} ({kind}, bare on core {cores[0]}): "
                  f"bare {figures['bare_ms']:.3f} ms a step; "
                  f"throughput bare / other {figures['wall']:.4f}, training thread's CPU "
                  f"{figures['cpu']:.4f} ({figures['added_us']:+.1f} µs a step)")
        received = finish()
    result: dict[str, Any] = {f"{kind}{suffix}": statistics.median(p[figure] for p in per_pair[kind])
              for kind in per_pair for suffix, figure in (("", "wall"), ("_cpu", "cpu"),
                                                          ("_added_us", "added_us"))}
    result["bare_ms"] = statistics.median(p["bare_ms"] for p in per_pair["run"] + per_pair["control"])
    result["run_pairs"] = [p["wall"] for p in per_pair["run"]]
    result["control_pairs"] = [p["wall"] for p in per_pair["control"]]
    print(f"cpu {' '.join(extra) or 'example'}: {pairs} pairs of each kind, {rounds} rounds of "
          f"{block_steps}-step turns ({result['bare_ms']:.2f} ms a bare step), {received} records received")
    for kind, name in (("run", "gpumon run"), ("control", "bare (control)")):
        print(f"  {name:15s} throughput / bare {result[kind]:.4f} (pairs "
              f"{' '.join(f'{p:.4f}' for p in sorted(p['wall'] for p in per_pair[kind]))}); training "
              f"thread's CPU bare / it {result[kind + '_cpu']:.4f}, "
              f"{result[kind + '_added_us']:+.1f} µs a step")
    return result


def turns(socket_path: str, watched: bool, cores: tuple[int, int], rounds: int, block_steps: int,
          extra: tuple[str, ...], one_core: bool, malloc: dict[str, str]) -> dict[str, float]:
    """One pair: a bare worker on ``cores[0]`` and, on ``cores[1]``, one under ``gpumon run``
    (``watched``) or bare; each runs a block when told to, one at a time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **malloc}
    job = ["--job", " ".join(extra), *(["--one-core"] if one_core else [])]
    commands = [[sys.executable, __file__, "--cpu-worker", str(core), *job] for core in cores]
    if watched:
        commands[1] = [sys.executable, "-m", "gpumon.cli", "run", "--run", "bench-run-cpu", "--socket",
                       socket_path, "--", *commands[1]]
    with tempfile.TemporaryFile("w+") as errors, contextlib.ExitStack() as stack:
        workers = [stack.enter_context(subprocess.Popen(command, env=env, stdin=subprocess.PIPE,
                                                        stdout=subprocess.PIPE, stderr=errors, text=True))
                   for command in commands]

        def answer(worker: subprocess.Popen[str]) -> str:
            assert worker.stdout is not None
            line = worker.stdout.readline()
            if not line:
                errors.seek(0)
                sys.exit(f"a worker failed:\n{errors.read()[-6000:]}")
            return line

        for worker in workers:
            answer(worker)  # warmed up
        walls: list[list[float]] = [[], []]
        cpus: list[list[float]] = [[], []]
        for i in range(rounds):
            for w in ((0, 1) if i % 2 == 0 else (1, 0)):
                stdin = workers[w].stdin
                assert stdin is not None
                stdin.write(f"{block_steps}\n")
                stdin.flush()
                wall, cpu = map(float, answer(workers[w]).split())
                walls[w].append(wall)
                cpus[w].append(cpu)
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.close()
            if worker.wait(timeout=60) != 0:
                errors.seek(0)
                sys.exit(f"a worker failed:\n{errors.read()[-6000:]}")
    return {"wall": statistics.median(b / o for b, o in zip(*walls, strict=True)),
            "cpu": statistics.median(b / o for b, o in zip(*cpus, strict=True)),
            "added_us": statistics.median((o - b) / block_steps * 1e6 for b, o in zip(*cpus, strict=True)),
            "bare_ms": statistics.median(walls[0]) / block_steps * 1e3}


def cpu_worker(core: int, job_args: str, one_core: bool) -> None:
    """A process of the CPU example: the loop as the example runs it without gpumon (under
    ``gpumon run``, the hooks find its steps), pinned to ``core``. After ``WORKER_WARM_STEPS`` it
    says so, then runs the steps each line of stdin asks for, answering with their wall time
    and the training thread's CPU time."""
    if one_core:
        os.sched_setaffinity(0, {core})  # before torch starts a thread, or gpumon one
    from train_cpu import make_job, parse_args, train

    job = make_job(parse_args(["--threads", "1", *job_args.split()]))
    train(job, WORKER_WARM_STEPS)
    os.sched_setaffinity(0, {core})  # the training thread (gpumon's, started by now, stay off it)
    print("ready", flush=True)
    for line in sys.stdin:
        steps = int(line)
        c0, t0 = time.thread_time(), time.perf_counter()
        train(job, steps)
        print(time.perf_counter() - t0, time.thread_time() - c0, flush=True)


def ddp_blocks(rounds: int, block_steps: int) -> dict[str, float]:
    """The DDP job in one process per rank: a model plain and under ``gpumon run``'s hooks, and a
    second model plain (the control), in rotating blocks; rank 0's medians over rounds."""
    from bench_hook import drained_socket

    from gpumon.testing import free_port

    with drained_socket() as (socket_path, finish), tempfile.TemporaryDirectory() as results:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "BENCH_RUN_RESULTS": results,
               "GPUMON_SOCKET": socket_path, "GPUMON_RUN": "bench-run-ddp"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-port", str(free_port()), __file__, "--blocks-worker",
                   "--ddp-rounds", str(rounds), "--ddp-block-steps", str(block_steps)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the job failed:\n{done.stdout}\n{done.stderr[-6000:]}")
        figures = json.loads(Path(results, "rank0.json").read_text())
        received = finish()
    print(f"ddp in one process: {rounds} rounds of {block_steps}-step blocks "
          f"({figures['plain_ms']:.1f} ms a plain step), {figures['steps']} steps watched, "
          f"{received} records received; the training thread's CPU added a step under gpumon run "
          f"{figures['run_added_cpu_us']:+.0f} µs")
    for kind, name in (("run", "gpumon run"), ("control", "plain again (control)")):
        print(f"  {name:22s} throughput / plain {figures[kind]:.4f} "
              f"(quartiles {figures[kind + '_q1']:.4f} .. {figures[kind + '_q3']:.4f})")
    return figures


def ddp_blocks_worker(rounds: int, block_steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from gpumon.client.autowatch import hooks

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[dist.get_rank() % len(cores)]})  # and gloo's threads, made later
    x = torch.randn(2, 2048)
    jobs = {}
    for kind in ("plain", "control"):
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]))
        jobs[kind] = (model, torch.optim.SGD(model.parameters(), lr=1e-6))
    jobs["run"] = jobs["plain"]  # the same model, under the hooks

    def seconds(kind: str, steps: int) -> tuple[float, float]:
        model, optimizer = jobs[kind]
        if kind == "run":
            hooks.install()
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if kind == "run":
            hooks.take_out()
        return elapsed, cpu

    kinds = ["plain", "run", "control"]
    for kind in kinds:  # warm up: DDP sizes its buckets after its first step
        seconds(kind, 2)
    ratios: dict[str, list[float]] = {"run": [], "control": []}
    plain_s, added_cpu = [], []
    for result in rotated(rounds, kinds, lambda kind: seconds(kind, block_steps)):
        for kind in ratios:
            ratios[kind].append(result["plain"][0] / result[kind][0])
        plain_s.append(result["plain"][0] / block_steps)
        added_cpu.append((result["run"][1] - result["plain"][1]) / block_steps)
    steps = uninstall(hooks)
    figures: dict[str, float] = {"plain_ms": statistics.median(plain_s) * 1e3, "steps": steps,
                                 "run_added_cpu_us": statistics.median(added_cpu) * 1e6}
    for kind, values in ratios.items():
        q1, _, q3 = statistics.quantiles(values, n=4)
        figures.update({kind: statistics.median(values), f"{kind}_q1": q1, f"{kind}_q3": q3})
    if dist.get_rank() == 0:
        Path(os.environ["BENCH_RUN_RESULTS"], "rank0.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


@contextlib.contextmanager
def pinned(everything: bool) -> Iterator[Callable[[], None]]:
    """The training thread on a core of its own (the last) meanwhile, once it calls what this
    yields; with ``everything``, every thread it starts from now on too, gpumon's among them.
    (Linux: ``sched_setaffinity(0)`` sets the calling thread's cores, and a new thread starts
    with its parent's.)"""
    cores = os.sched_getaffinity(0)
    core = {max(cores)}
    if everything:
        os.sched_setaffinity(0, core)
    try:
        yield lambda: os.sched_setaffinity(0, core)
    finally:
        os.sched_setaffinity(0, cores)


def rotated(rounds: int, kinds: list[str], measure: Callable[[str], T]) -> Iterator[dict[str, T]]:
    """Each round's measure of every kind, the order rotating by one kind a round."""
    for i in range(rounds):
        shift = i % len(kinds)
        yield {kind: measure(kind) for kind in kinds[shift:] + kinds[:shift]}


def uninstall(hooks: Any) -> int:
    """Take ``gpumon run``'s hooks out for good; the steps they recorded."""
    finder = hooks._state.finder
    steps = 0 if finder is None else int(finder.monitor.stats.steps)
    hooks.uninstall()
    return steps


def ddp_pairs(pairs: int, steps: int) -> float:
    from bench_hook import drained_socket

    from gpumon.testing import free_port

    ratios = []
    with drained_socket() as (socket_path, finish):
        for pair in range(pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            step_s = {}
            for watched in order:
                with tempfile.TemporaryDirectory() as results:
                    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                           "BENCH_RUN_RESULTS": results}
                    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-port", str(free_port()), __file__, "--worker",
                               "--ddp-steps", str(steps)]
                    if watched:
                        command = [sys.executable, "-m", "gpumon.cli", "run", "--run", "bench-run-ddp",
                                   "--socket", socket_path, "--", *command]
                    done = subprocess.run(command, env=env, capture_output=True, text=True)
                    if done.returncode != 0:
                        sys.exit(f"the job failed:\n{done.stdout}\n{done.stderr[-6000:]}")
                    ranks = [json.loads(p.read_text()) for p in Path(results).glob("rank*.json")]
                    step_s[watched] = statistics.median(r["step_s"] for r in ranks)
            ratios.append(step_s[False] / step_s[True])
            print(f"ddp pair {pair}: plain {step_s[False] * 1e3:.1f} ms, under gpumon run "
                  f"{step_s[True] * 1e3:.1f} ms a step: throughput ratio {ratios[-1]:.4f}")
        received = finish()
    print(f"ddp: {received} records received; median throughput ratio {statistics.median(ratios):.4f}")
    return statistics.median(ratios)


def ddp_worker(steps: int) -> None:
    """One rank of the plain DDP job: its median step time after three warm-up steps."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(2, 2048)
    times = []
    for i in range(3 + steps):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    rank = dist.get_rank()
    Path(os.environ["BENCH_RUN_RESULTS"], f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "step_s": statistics.median(times)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
