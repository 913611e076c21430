"""Make a report: load the run from its source, draw the page, write it whole or not at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from gpumon.report.model import ReportError, RunModel


def load(recording: Path | None = None, prometheus: str | None = None, run: str | None = None,
         since: str = "6h", timeout_s: float = 30.0) -> RunModel:
    """The run's model from a recording file or a Prometheus-compatible server."""
    if recording is not None:
        from gpumon.report.recording import load_file

        return load_file(recording, run)
    if prometheus is None:
        raise ReportError("give a recording or a Prometheus URL")
    if run is None:
        from gpumon.report.prometheus import PrometheusSource

        runs = PrometheusSource(prometheus, timeout_s).runs(since)
        raise ReportError(f"give --run with --prometheus; the runs there are: "
                          f"{', '.join(repr(r) for r in runs) or 'none'}")
    from gpumon.report.prometheus import load_prometheus

    return load_prometheus(prometheus, run, since, timeout_s)


def write(model: RunModel, output: Path) -> int:
    """Write the page atomically (a reader never sees half of it); returns its size in bytes."""
    try:
        from gpumon.report.page import render
    except ImportError as exc:
        raise ReportError(f"the page needs plotly ({exc}): pip install 'gpumon[report]'") from exc
    data = render(model).encode("utf-8")
    directory = output.resolve().parent
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{output.name}.", dir=directory)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, output)
    except OSError as exc:
        raise ReportError(f"cannot write {output}: {exc.strerror or exc}") from exc
    return len(data)


def make_report(output: Path, *, recording: Path | None = None, prometheus: str | None = None,
                run: str | None = None, since: str = "6h", timeout_s: float = 30.0,
                warn: Callable[[str], None] = lambda _line: None) -> str:
    """Load, draw and write; ``warn`` gets what was skipped. Returns the line to print."""
    model = load(recording, prometheus, run, since, timeout_s)
    for note in model.notes:
        warn(f"gpumon report: {note}")
    size = write(model, output)
    return (f"gpumon report: wrote {output} ({size / 1e6:.1f} MB): run {model.run!r}, "
            f"{model.summary.steps} steps of {model.summary.ranks} ranks, from {model.source}")


def demo_report(recording: Path) -> Path:
    """The page of ``gpumon demo``'s run, beside its recording."""
    output = recording.with_suffix(".html")
    write(load(recording), output)
    return output


__all__ = ["ReportError", "demo_report", "load", "make_report", "write"]
