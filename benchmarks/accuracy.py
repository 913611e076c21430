"""Step-level accuracy of the bottleneck classifier on the labelled recordings in tests/data/.

    .venv/bin/python benchmarks/accuracy.py

Each tests/data/<scenario>/ holds recording.jsonl (made by tests/data/make_recordings.py
from real agent runs) and labels.json (the ground truth the workload was built to be).
A label "not_input" counts a step as right when it is not classified input-bound.

The gpu_* recordings are synthetic: their GPU is the fake NVML, its counters set to the regime,
and the job's phases are sleeps made to match. They show the rules classify the regime they were
built for, not accuracy on real GPUs; the output says which rows are synthetic.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpumon.commands.classify import classify_file  # noqa: E402

DATA = ROOT / "tests" / "data"


def scenario_accuracy(directory: Path) -> tuple[str, int, int]:
    """(label, steps right, steps) for one labelled recording."""
    label = json.loads((directory / "labels.json").read_text())["primary"]
    _, verdicts = classify_file(directory / "recording.jsonl")
    right = total = 0
    for v in verdicts:
        primary = v.verdict.primary.value
        ok = primary != "input" if label == "not_input" else primary == label
        total += len(v.steps)
        right += len(v.steps) if ok else 0
    return label, right, total


def is_synthetic(directory: Path) -> bool:
    """Whether the recording's GPU was the fake NVML (its counters set, not measured)."""
    source = json.loads((directory / "labels.json").read_text()).get("source", "")
    return "fake NVML" in source


def main() -> None:
    rows = [(d.name, is_synthetic(d), *scenario_accuracy(d)) for d in sorted(DATA.iterdir())
            if (d / "labels.json").exists()]
    print(f"{'scenario':<24} {'recording':<10} {'ground truth':<18} {'steps':>6} {'right':>6} "
          f"{'accuracy':>9}")
    for name, synthetic, label, right, total in rows:
        kind = "synthetic" if synthetic else "real"
        print(f"{name:<24} {kind:<10} {label:<18} {total:>6} {right:>6} {right / max(total, 1):>8.1%}")
    print("synthetic: fake-NVML GPU counters and a scripted job; not accuracy on real GPUs")
    print(json.dumps({name: {"label": label, "synthetic": synthetic, "steps": total,
                             "accuracy": right / max(total, 1)}
                      for name, synthetic, label, right, total in rows}))


if __name__ == "__main__":
    main()
