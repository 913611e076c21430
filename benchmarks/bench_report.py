"""`gpumon report` on a long recording: its time and peak memory, a day against an hour.

    .venv/bin/python benchmarks/bench_report.py [--ranks 64] [--step-seconds 20] [--hours 24]
        [--against DIR] [--rounds 1]

Writes a recording of ``--ranks`` ranks stepping every ``--step-seconds`` for ``--hours``
(rank 2 a straggler, GPU samples of 8 GPUs every second, as an agent records them;
``gpumon/testing/recordings.py``), and the same run cut to one hour, then runs
``gpumon report`` on each in its own process: wall time, CPU time and peak RSS (the child's
``ru_maxrss``), and the page's size. The hour is the baseline: a report whose memory grew with
the recording would show it against the day.

``--against DIR`` names a source tree of other code (an earlier commit, ``git archive``'d):
each recording is then reported by both, alternating for ``--rounds`` rounds in this one run,
so the ratio of their times is read on one machine under one load; the two pages must be the
same bytes, or the benchmark fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import print_table

from gpumon.testing import agent_env
from gpumon.testing.recordings import Run, write

ROOT = Path(__file__).resolve().parent.parent


def measure(recording: Path, page: Path, code: Path = ROOT) -> dict[str, float]:
    """One ``gpumon report`` in a child process of its own, of the code under ``code``."""
    env = agent_env()
    env["PYTHONPATH"] = str(code)
    began = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "gpumon.cli", "report", str(recording),
                                "-o", str(page)], env=env, cwd=code,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, _, usage = os.wait4(process.pid, 0)
    wall = time.monotonic() - began
    err = process.stderr.read().decode() if process.stderr else ""
    if not page.exists():
        raise SystemExit(f"gpumon report failed on {recording}: {err}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "page_bytes": page.stat().st_size,
            "recording_bytes": recording.stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--step-seconds", type=float, default=20.0)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--against", type=Path, default=None,
                        help="a source tree of other code to report each recording alternately")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    codes = {"this": ROOT} if args.against is None else {"this": ROOT,
                                                         "against": args.against.resolve()}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        for name, hours in (("hour", 1.0), ("day", args.hours)):
            steps = int(hours * 3600 / args.step_seconds)
            run = Run(ranks=args.ranks, steps=steps, step_s=args.step_seconds,
                      peak_growth=1024.0)
            began = time.monotonic()
            recording = write(Path(tmp) / f"{name}.jsonl", run)
            written = time.monotonic() - began
            for round_ in range(args.rounds):
                order = list(codes.items()) if round_ % 2 == 0 else list(codes.items())[::-1]
                for code_name, code in order:
                    page = Path(tmp) / f"{name}-{code_name}.html"
                    key = name if args.against is None else f"{name} {code_name} {round_ + 1}"
                    results[key] = {"steps": steps * args.ranks, "hours": hours,
                                    "write_s": written, **measure(recording, page, code)}
                if args.against is not None and (Path(tmp) / f"{name}-this.html").read_bytes() \
                        != (Path(tmp) / f"{name}-against.html").read_bytes():
                    raise SystemExit(f"the two pages of the {name} differ")
            recording.unlink()
    rows = [[name, f"{r['hours']:g} h", f"{r['steps']:,}", f"{r['recording_bytes'] / 1e6:,.0f} MB",
             f"{r['wall_s']:.1f} s", f"{r['cpu_s']:.1f} s", f"{r['peak_rss_bytes'] / 1e6:.0f} MB",
             f"{r['page_bytes'] / 1e6:.2f} MB"] for name, r in results.items()]
    print_table(["recording", "span", "steps", "file", "wall", "CPU", "peak RSS", "page"], rows)
    if args.against is not None:
        for name in ("hour", "day"):
            ratios = [results[f"{name} this {k}"]["cpu_s"] / results[f"{name} against {k}"]["cpu_s"]
                      for k in range(1, args.rounds + 1)]
            print(f"{name}: CPU time of this code over the other's, round by round: "
                  + ", ".join(f"{r:.3f}" for r in ratios))
    print(json.dumps({"ranks": args.ranks, "step_seconds": args.step_seconds,
                      "results": results}))


if __name__ == "__main__":
    main()
