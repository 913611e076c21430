"""`gpumon classify`: replay a JSONL recording through the same verdict engine as the agent."""

from __future__ import annotations

import json
import statistics
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpumon.agent.recorder import sample_from_line, time_from_line
from gpumon.analysis.goodput import TimeTotals
from gpumon.analysis.stream import StepAnalyzer, StepVerdict
from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.wire import HelloRecord, ParallelLayout, ProtocolError, StepRecord, decode_record


@dataclass
class Recording:
    """A parsed recording: GPU samples by index, steps in order, and what was unreadable."""

    samples: dict[int, list[GpuSample]] = field(default_factory=lambda: defaultdict(list))
    statics: dict[int, GpuStatic] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    layouts: dict[tuple[str, int], ParallelLayout] = field(default_factory=dict)
    """Each rank's place in its job's parallelism, from the recorded hellos (the latest)."""
    times: dict[tuple[str, int], tuple[float, TimeTotals]] = field(default_factory=dict)
    """Where each rank's time went, from its latest ``time`` line: (unix time, figures)."""
    skipped: Counter[str] = field(default_factory=Counter)
    skipped_at: list[tuple[int, str]] = field(default_factory=list)
    """(line number from 1, reason) of every line skipped, in file order."""

    def skip(self, line_number: int, reason: str) -> None:
        """Count a line that could not be used."""
        self.skipped[reason] += 1
        self.skipped_at.append((line_number, reason))


def load_recording(lines: Iterable[str]) -> Recording:
    """Parse recording lines; bad lines are counted by reason, never fatal."""
    recording = Recording()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError:
            recording.skip(number, "not_json")
            continue
        kind = line.get("kind") if isinstance(line, dict) else None
        if kind == "gpu":
            try:
                sample = sample_from_line(line)
            except (KeyError, TypeError, ValueError):
                recording.skip(number, "bad_gpu_line")
                continue
            recording.samples[sample.index].append(sample)
            if sample.index not in recording.statics:
                recording.statics[sample.index] = GpuStatic(
                    index=sample.index, uuid=str(line.get("uuid", f"gpu-{sample.index}")),
                    name=str(line.get("model", "")), pci_bus_id="",
                    memory_total_bytes=line.get("memory_total_bytes"))
        elif kind == "step":
            try:
                record = decode_record(line)
            except ProtocolError as exc:
                recording.skip(number, exc.reason)
                continue
            if isinstance(record, StepRecord):
                recording.steps.append(record)
        elif kind == "hello":
            try:
                hello = decode_record(line)
            except ProtocolError as exc:
                recording.skip(number, exc.reason)
                continue
            if isinstance(hello, HelloRecord) and hello.parallel is not None:
                recording.layouts[(hello.run, hello.rank)] = hello.parallel
        elif kind == "time":
            try:
                run, rank, t, totals = time_from_line(line)
            except (KeyError, TypeError, ValueError):
                recording.skip(number, "bad_time_line")
                continue
            if t >= recording.times.get((run, rank), (float("-inf"),))[0]:
                recording.times[(run, rank)] = (t, totals)
        else:
            recording.skip(number, "unknown_kind")
    for samples in recording.samples.values():
        samples.sort(key=lambda s: s.t)
    return recording


def _resolution(recording: Recording) -> float:
    gaps = [b.t - a.t for samples in recording.samples.values()
            for a, b in zip(samples, samples[1:], strict=False) if b.t > a.t]
    return statistics.median(gaps) if gaps else 1.0


def classify_recording(recording: Recording) -> list[StepVerdict]:
    """Every step's verdict, replayed in time order with the samples recorded around it."""
    analyzer = StepAnalyzer(resolution_s=_resolution(recording))
    times = {i: [s.t for s in samples] for i, samples in recording.samples.items()}

    def history(index: int, t0: float, t1: float) -> list[GpuSample]:
        samples = recording.samples.get(index, [])
        ts = times.get(index, [])
        return samples[bisect_left(ts, t0):bisect_right(ts, t1)]

    statics = list(recording.statics.values())
    steps = sorted(recording.steps, key=lambda s: (s.t_end or 0.0, s.run, s.rank, s.step))
    verdicts: list[StepVerdict] = []
    # Feed steps as a live agent would receive them, processing as time advances, so
    # straggler scores and OOM trends build up in order.
    for step in steps:
        end = step.t_end or 0.0
        analyzer.add([step], received_t=end)
        latest = {i: s[max(bisect_right(times[i], end) - 1, 0)]
                  for i, s in recording.samples.items() if s}
        verdicts += analyzer.process(end, history, statics, latest, recording.layouts)
    verdicts += analyzer.process(float("inf"), history, statics,
                                 {i: s[-1] for i, s in recording.samples.items() if s},
                                 recording.layouts)
    return verdicts


def summarize(verdicts: list[StepVerdict]) -> dict[str, object]:
    """Steps per primary bottleneck, overall and per (run, rank)."""
    overall: Counter[str] = Counter()
    per_rank: dict[str, Counter[str]] = defaultdict(Counter)
    for v in verdicts:
        overall[v.verdict.primary.value] += len(v.steps)
        per_rank[f"{v.run}/{v.rank}"][v.verdict.primary.value] += len(v.steps)
    return {"steps": sum(overall.values()), "bottlenecks": dict(overall),
            "ranks": {k: dict(c) for k, c in sorted(per_rank.items())}}


def classify_file(path: Path) -> tuple[Recording, list[StepVerdict]]:
    """Load and classify a recording file."""
    with open(path, encoding="utf-8", errors="replace") as lines:
        recording = load_recording(lines)
    return recording, classify_recording(recording)


SKIPPED_SHOWN = 20  # lines named one by one; the rest are counted


def output_lines(path: Path, json_output: bool,
                 warn: Callable[[str], None] = lambda _message: None) -> Iterator[str]:
    """What ``gpumon classify`` prints: a line per verdict (with ``json_output``, a JSON line
    per step), then the summary; ``warn`` gets a line per skipped line (for stderr). The file
    is read before the first line is given, so an unreadable file raises ``OSError`` from
    this call, not from the iteration."""
    recording, verdicts = classify_file(path)
    for number, reason in recording.skipped_at[:SKIPPED_SHOWN]:
        warn(f"gpumon classify: {path}:{number}: skipped ({reason})")
    more = len(recording.skipped_at) - SKIPPED_SHOWN
    if more > 0:
        warn(f"gpumon classify: {path}: {more} more lines skipped")
    return _lines(recording, verdicts, json_output)


def _lines(recording: Recording, verdicts: list[StepVerdict], json_output: bool) -> Iterator[str]:
    summary = summarize(verdicts)
    if recording.skipped:
        summary["skipped_lines"] = dict(recording.skipped)
    if json_output:
        for v in verdicts:
            for step in v.steps:
                yield json.dumps({
                    "run": v.run, "rank": v.rank, "step": step,
                    "primary": v.verdict.primary.value,
                    "confidence": round(v.verdict.confidence, 3),
                    "flags": sorted(f.value for f in v.verdict.flags)})
        yield json.dumps({"summary": summary})
        return
    for v in verdicts:
        steps = f"{v.steps[0]}" if len(v.steps) == 1 else f"{v.steps[0]}-{v.steps[-1]}"
        flags = f" [{', '.join(sorted(f.value for f in v.verdict.flags))}]" if v.verdict.flags else ""
        yield (f"{v.run} rank {v.rank} step {steps}: {v.verdict.primary.value} "
               f"({v.verdict.confidence:.0%}){flags} — {v.verdict.hint}")
    yield f"summary: {json.dumps(summary)}"
