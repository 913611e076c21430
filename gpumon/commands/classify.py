"""`gpumon classify`: replay a JSONL recording through the same verdict engine as the agent."""

from __future__ import annotations

import json
import statistics
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


Parsed = tuple[str, Any]
"""One recording line as ``parse_line`` reads it: ``("step", StepRecord)``, ``("gpu", (GpuSample,
line))``, ``("hello", ((run, rank), ParallelLayout) or None)``, ``("time", (run, rank, t,
totals))``, ``("skip", reason)``, or ``("none", None)`` for a blank line or a step line whose
record is of another type."""


_scan_once: Callable[[str, int], tuple[Any, int]] = \
    json.JSONDecoder().scan_once  # type: ignore[attr-defined]  # set in its __init__
"""The scanner of ``json.loads``'s own decoder (the same settings: no hooks, strict)."""


def _loads(text: str) -> Any:
    """``json.loads(text)``, without its wrappers where the line is one value and at most a
    newline after it (a recording's line, as read from its file): a million lines a day.
    Anything else (leading or other trailing whitespace, a BOM, bad JSON) goes to
    ``json.loads`` itself, which reads it or raises as it always does."""
    try:
        value, end = _scan_once(text, 0)
    except (StopIteration, ValueError):
        return json.loads(text)
    if end == len(text) or (end == len(text) - 1 and text[end] == "\n"):
        return value
    return json.loads(text)


def parse_line(text: str) -> Parsed:
    """One recording line, never raising: what it holds, or why it cannot be used. The one
    parser of ``load_recording`` and of the report's streaming passes, so both read a file
    alike."""
    if not text or text.isspace():  # not text.strip(), without copying every line
        return "none", None
    try:
        line = _loads(text)
    except ValueError:
        return "skip", "not_json"
    kind = line.get("kind") if isinstance(line, dict) else None
    if kind == "step":
        try:
            record = decode_record(line)
        except ProtocolError as exc:
            return "skip", exc.reason
        return ("step", record) if isinstance(record, StepRecord) else ("none", None)
    if kind == "gpu":
        try:
            return "gpu", (sample_from_line(line), line)
        except (KeyError, TypeError, ValueError):
            return "skip", "bad_gpu_line"
    if kind == "hello":
        try:
            hello = decode_record(line)
        except ProtocolError as exc:
            return "skip", exc.reason
        if isinstance(hello, HelloRecord) and hello.parallel is not None:
            return "hello", ((hello.run, hello.rank), hello.parallel)
        return "hello", None
    if kind == "time":
        try:
            return "time", time_from_line(line)
        except (KeyError, TypeError, ValueError):
            return "skip", "bad_time_line"
    return "skip", "unknown_kind"


def static_from_line(index: int, line: dict[str, Any]) -> GpuStatic:
    """What a GPU line says of GPU ``index``: the first line of each GPU names it."""
    return GpuStatic(index=index, uuid=str(line.get("uuid", f"gpu-{index}")),
                     name=str(line.get("model", "")), pci_bus_id="",
                     memory_total_bytes=line.get("memory_total_bytes"))


def keep_latest(times: dict[tuple[str, int], tuple[float, TimeTotals]],
                line: tuple[str, int, float, TimeTotals]) -> None:
    """A rank's time line into ``times``, where it is its latest."""
    run, rank, t, totals = line
    if t >= times.get((run, rank), (float("-inf"),))[0]:
        times[(run, rank)] = (t, totals)


def load_recording(lines: Iterable[str]) -> Recording:
    """Parse recording lines; bad lines are counted by reason, never fatal."""
    recording = Recording()
    for number, text in enumerate(lines, start=1):
        kind, value = parse_line(text)
        if kind == "step":
            recording.steps.append(value)
        elif kind == "gpu":
            sample, line = value
            recording.samples[sample.index].append(sample)
            if sample.index not in recording.statics:
                recording.statics[sample.index] = static_from_line(sample.index, line)
        elif kind == "hello":
            if value is not None:
                key, layout = value
                recording.layouts[key] = layout
        elif kind == "time":
            keep_latest(recording.times, value)
        elif kind == "skip":
            recording.skip(number, value)
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
