"""A rank on CUDA times its phases on the GPU on a sample of steps and on the host clock on
the rest; a window's phase shares come from the GPU-timed steps (``device_timing``).

The labelled recordings of tests/data were made with every step's phases as the GPU ran them.
Rewritten as a sampling client sends them (every other step GPU-timed and saying so in
``dev``, the rest with host-clock phases that measure only the kernel launches), they must get
the same verdicts; without the rule, the launch times outvote the GPU times."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.accuracy import DATA, scenario_accuracy
from gpumon.analysis.bottleneck import phase_fractions
from gpumon.analysis.device_timing import device_shares, window_phases
from gpumon.analysis.window import merge_steps
from gpumon.wire import StepRecord

LAUNCH_RATIO = 0.03
"""Host-clock time of a CUDA phase as a share of its GPU time on a GPU-bound step: the CPU
only launches the kernels and runs ahead."""
GPU_PHASES = ("forward", "backward", "comm", "optimizer")


def step(n: int, phases: dict[str, float], dev: tuple[str, ...] | None = None) -> StepRecord:
    return StepRecord("gpu", 0, n, 0.002, t_start=1000.0 + n * 0.002, phases_s=phases, device_phases=dev)


def test_gpu_timed_shares_apply_to_the_whole_window() -> None:
    host = {"data": 0.0001, "forward": 0.00005, "backward": 0.00008}
    gpu = {"data": 0.0001, "forward": 0.0007, "backward": 0.0011}
    steps = [step(0, gpu, ("forward", "backward"))] + [step(n, host) for n in range(1, 10)]
    phases, names = window_phases(steps)
    assert names == ("forward", "backward")
    assert phases["data"] == pytest.approx(0.001)  # host-timed everywhere: summed
    assert phases["forward"] == pytest.approx(0.0007 * 10)  # its GPU share of 10 steps' time
    assert phases["backward"] == pytest.approx(0.0011 * 10)
    merged = merge_steps(steps)
    assert merged.device_phases == ("forward", "backward")
    shares = phase_fractions(merged)
    assert shares is not None and shares["compute"] == pytest.approx(0.9, rel=0.02)
    # Summing both kinds, as before the rule, says the step is mostly unattributed time.
    plain = merge_steps([dataclasses.replace(s, device_phases=None) for s in steps])
    plain_shares = phase_fractions(plain)
    assert plain_shares is not None and plain_shares["compute"] < 0.2


def test_a_window_without_gpu_timed_steps_is_summed_as_before() -> None:
    steps = [step(n, {"data": 0.0001 * n, "forward": 0.001}) for n in range(5)]
    phases, names = window_phases(steps)
    assert names is None and phases == {"data": pytest.approx(0.001), "forward": pytest.approx(0.005)}
    assert merge_steps(steps).device_phases is None
    # An empty dev (events not read in time) is no GPU-timed step either.
    phases, names = window_phases([dataclasses.replace(s, device_phases=()) for s in steps])
    assert names is None and phases["forward"] == pytest.approx(0.005)


def test_a_phase_timed_on_the_gpu_in_some_steps_only_counts_there() -> None:
    # "comm" was GPU-timed in the sampled step but the host-timed steps never ran it: its
    # share is still that of the sampled step, applied to the window.
    steps = [step(0, {"forward": 0.001, "comm": 0.0008}, ("forward", "comm")),
             step(1, {"forward": 0.0001})]
    phases, _ = window_phases(steps)
    assert phases == {"forward": pytest.approx(0.002), "comm": pytest.approx(0.0016)}
    assert device_shares(steps) == {"forward": pytest.approx(0.5), "comm": pytest.approx(0.4)}


def test_a_window_without_gpu_timed_steps_takes_the_latest_shares() -> None:
    host = step(5, {"data": 0.0002, "forward": 0.00005})
    merged = merge_steps([host], {"forward": 0.8})
    assert merged.phases_s == {"data": 0.0002, "forward": pytest.approx(0.0016)}
    assert merged.device_phases == ("forward",)
    assert merge_steps([host]) is host  # a rank that never sent GPU-timed steps: unchanged


def sampled_recording(source: Path, target: Path, with_dev: bool) -> None:
    """``source`` as a sampling client would have sent it: odd steps host-timed."""
    target.mkdir()
    (target / "labels.json").write_text((source / "labels.json").read_text())
    lines = []
    for line in (source / "recording.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "step" and record.get("phases"):
            timed = [name for name in record["phases"] if name in GPU_PHASES]
            if record["step"] % 2:
                for name in timed:
                    record["phases"][name] *= LAUNCH_RATIO
            elif with_dev and timed:
                record["dev"] = timed
        lines.append(json.dumps(record))
    (target / "recording.jsonl").write_text("\n".join(lines) + "\n")


GPU_SCENARIOS = sorted(d for d in DATA.iterdir()
                       if d.name.startswith("gpu_") and (d / "labels.json").exists())


@pytest.mark.parametrize("scenario", GPU_SCENARIOS, ids=lambda d: d.name)
def test_sampled_recordings_get_the_labelled_verdicts(scenario: Path, tmp_path: Path) -> None:
    original = scenario_accuracy(scenario)
    sampled = tmp_path / scenario.name
    sampled_recording(scenario, sampled, with_dev=True)
    label, right, total = scenario_accuracy(sampled)
    assert total == original[2] >= 50
    assert right / total >= 0.9, f"{scenario.name}: {right}/{total} steps classified {label}"


def test_without_the_field_host_times_would_hide_the_communication_wall(tmp_path: Path) -> None:
    # The proof that the rule above is what keeps the verdicts: the same sampled recording
    # without "dev" loses the communication verdict on every host-timed step (half of them).
    scenario = DATA / "gpu_communication"
    sampled = tmp_path / "no_dev"
    sampled_recording(scenario, sampled, with_dev=False)
    _, right, total = scenario_accuracy(sampled)
    assert right <= total // 2
