"""The monitor's extension point: watchers add measured fields (``comm``, ``memb``) to step
records; they cost nothing when none is registered, and their failures never reach the
training loop.

Runs on whichever core the monitor uses (the C one where built; the pure-Python one under
``GPUMON_PURE_PYTHON=1``, which ``test_core`` runs); ``test_core`` also drives both cores'
extension calls directly.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from gpumon.client import StepMonitor
from gpumon.client.core.extensions import MAX_CONSECUTIVE_FAILURES
from gpumon.client.core.transport import MemoryTransport
from gpumon.client.monitor import IMPLEMENTATION
from gpumon.wire import CollectiveOp, CommStats, MemoryBreakdown
from tests.client.conftest import Receiver
from tests.helpers import steps_of

COMM = {"exposed": 0.0, "busy": 0.0, "ops": {"all_reduce": [2, 4096, 0.0]}}


class Counting:
    """An extension that reports a ``comm`` field whose count is its step number."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def step_begin(self) -> None:
        self.calls.append("begin")

    def step_end(self, fields: dict[str, object]) -> None:
        self.calls.append("end")
        fields["comm"] = {**COMM, "ops": {"all_reduce": [len(self.calls) // 2, 4096, 0.0]}}


class Breakdown:
    def step_begin(self) -> None:
        pass

    def step_end(self, fields: dict[str, object]) -> None:
        fields["memb"] = {"parameters": 1000, "gradients": 1000, "optimizer_states": 2000}


class Failing:
    def __init__(self, where: str, times: int = 10**9) -> None:
        self.where, self.times, self.calls = where, times, 0

    def step_begin(self) -> None:
        self.calls += 1
        if self.where == "begin" and self.calls <= self.times:
            raise RuntimeError("watcher bug at begin")

    def step_end(self, fields: dict[str, object]) -> None:
        fields["memb"] = {"activations": 5}
        if self.where == "end" and self.calls <= self.times:
            raise RuntimeError("watcher bug at end")


@pytest.fixture
def transport() -> MemoryTransport:
    return MemoryTransport()


@pytest.fixture
def mon(transport: MemoryTransport) -> Iterator[StepMonitor]:
    monitor = StepMonitor(run="ext", transport=transport, rank=0, world=1)
    yield monitor
    monitor.close()


def run_steps(mon: StepMonitor, n: int) -> None:
    for _ in range(n):
        with mon.step(samples=4):
            with mon.phase("forward"):
                pass


def test_fields_an_extension_sets_reach_the_agent(mon: StepMonitor, transport: MemoryTransport) -> None:
    run_steps(mon, 1)  # before registration: no fields
    counting = mon.extensions.attach(Counting)
    mon.extensions.attach(Breakdown)
    assert mon.extensions.attach(Counting) is counting  # again: still called once per step
    run_steps(mon, 3)
    mon.flush()
    steps = steps_of(transport)
    assert [s.step for s in steps] == [0, 1, 2, 3]
    assert steps[0].comm is None and steps[0].memory_breakdown is None
    assert [s.comm for s in steps[1:]] == [
        CommStats(0.0, 0.0, (CollectiveOp("all_reduce", n, 4096, 0.0),)) for n in (1, 2, 3)
    ]
    assert {s.memory_breakdown for s in steps[1:]} == {MemoryBreakdown(1000, 1000, 2000)}
    assert counting.calls == ["begin", "end"] * 3
    assert all(s.samples == 4 and "forward" in s.phases_s for s in steps)
    assert mon.stats.invalid_fields == 0 and mon.stats.extension_errors == 0


def test_nested_steps_call_extensions_once(mon: StepMonitor, transport: MemoryTransport) -> None:
    counting = mon.extensions.attach(Counting)
    with mon.step():
        with mon.step():
            pass
    assert counting.calls == ["begin", "end"]


def test_fields_reach_the_agent_through_the_real_socket(receiver: Receiver) -> None:
    mon = StepMonitor(run="ext-socket", socket_path=str(receiver.path), rank=0, world=1)
    try:
        mon.extensions.attach(Counting)
        mon.extensions.attach(Breakdown)
        run_steps(mon, 5)
        mon.flush()
        steps = receiver.wait_for_steps(5)
    finally:
        mon.close()
    assert [s.comm.ops[0].count for s in steps] == [1, 2, 3, 4, 5]  # type: ignore[union-attr]
    assert all(s.memory_breakdown == MemoryBreakdown(1000, 1000, 2000) for s in steps)
    assert receiver.rejected == []


def test_a_failed_step_still_ends_its_extensions_and_sends_nothing(
    mon: StepMonitor, transport: MemoryTransport
) -> None:
    counting = mon.extensions.attach(Counting)
    with pytest.raises(KeyError):
        with mon.step():
            raise KeyError("boom")
    run_steps(mon, 1)
    mon.flush()
    assert counting.calls == ["begin", "end", "begin", "end"]  # the watcher can undo its setup
    [step] = steps_of(transport)
    assert step.comm is not None and step.comm.ops[0].count == 2


@pytest.mark.parametrize("where", ["begin", "end"])
def test_an_extension_that_keeps_failing_is_switched_off(
    mon: StepMonitor, transport: MemoryTransport, where: str
) -> None:
    failing = mon.extensions.attach(Failing, lambda: Failing(where))
    mon.extensions.attach(Counting)
    run_steps(mon, MAX_CONSECUTIVE_FAILURES + 4)  # never raises into the loop
    mon.flush()
    steps = steps_of(transport)
    assert len(steps) == MAX_CONSECUTIVE_FAILURES + 4
    assert failing.calls == MAX_CONSECUTIVE_FAILURES  # then no longer called
    assert mon.stats.extension_errors == MAX_CONSECUTIVE_FAILURES
    # A failing extension's own fields are not trusted; the healthy one's arrive every step.
    assert all(s.memory_breakdown is None for s in steps)
    assert [s.comm.ops[0].count for s in steps] == list(range(1, len(steps) + 1))  # type: ignore[union-attr]


def test_an_occasional_failure_costs_only_that_steps_field(
    mon: StepMonitor, transport: MemoryTransport
) -> None:
    mon.extensions.attach(Failing, lambda: Failing("end", times=MAX_CONSECUTIVE_FAILURES - 1))
    run_steps(mon, MAX_CONSECUTIVE_FAILURES + 2)
    mon.flush()
    breakdowns = [s.memory_breakdown for s in steps_of(transport)]
    assert breakdowns == [None] * (MAX_CONSECUTIVE_FAILURES - 1) + [MemoryBreakdown(activations=5)] * 3
    assert mon.stats.extension_errors == MAX_CONSECUTIVE_FAILURES - 1


class Sets:
    def __init__(self, fields: dict[str, object]) -> None:
        self.fields = fields

    def step_begin(self) -> None:
        pass

    def step_end(self, fields: dict[str, object]) -> None:
        fields.update(self.fields)


@pytest.mark.parametrize(
    "bad",
    [
        {"comm": {"exposed": 5.0, "busy": 5.0}},  # longer than the step
        {"comm": {"exposed": float("nan"), "busy": 0.0}},
        {"comm": {"exposed": 0.0}},
        {"memb": {"parameters": -1}},
        {"memb": {"other": object()}},
        {"step": 99},  # not a measured field: would overwrite the record's own
        {"phases": {}},
    ],
    ids=repr,
)
def test_a_field_the_agent_would_refuse_is_left_out_not_the_record(
    mon: StepMonitor, transport: MemoryTransport, bad: dict[str, object]
) -> None:
    mon.extensions.attach(Sets, lambda: Sets({**bad, "memb": bad.get("memb", {"gradients": 7})}))
    with mon.step():
        pass
    mon.flush()
    [step] = steps_of(transport)
    assert step.step == 0 and step.comm is None
    assert step.memory_breakdown == (None if "memb" in bad else MemoryBreakdown(gradients=7))
    assert mon.stats.invalid_fields == 1 and mon.stats.extension_errors == 0


def python_calls_during(fn: object) -> list[str]:
    """The Python functions called (from anywhere, C included) while ``fn`` runs."""
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            calls.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_qualname}")

    gc.collect()
    gc.disable()  # a collection in the window would run weakref callbacks of other objects
    sys.setprofile(profile)
    try:
        fn()  # type: ignore[operator]
    finally:
        sys.setprofile(None)
        gc.enable()
    return [c for c in calls if not c.endswith("python_calls_during")]


def test_no_extension_no_calls(mon: StepMonitor) -> None:
    run_steps(mon, 2)  # past the first step's one-off CUDA check
    calls = python_calls_during(lambda: run_steps(mon, 50))
    assert not [c for c in calls if c.startswith("extensions.py")]
    if IMPLEMENTATION == "c":  # the C core calls into Python for nothing at all
        assert calls == [c for c in calls if c.startswith("test_extensions.py")]
    mon.extensions.attach(Counting)
    calls = python_calls_during(lambda: run_steps(mon, 50))
    assert calls.count("extensions.py:StepExtensions.begin") == 50


def test_all_extensions_switched_off_means_no_calls_again(mon: StepMonitor) -> None:
    mon.extensions.attach(Failing, lambda: Failing("begin"))
    run_steps(mon, MAX_CONSECUTIVE_FAILURES)
    calls = python_calls_during(lambda: run_steps(mon, 20))
    assert not [c for c in calls if c.startswith("extensions.py")]


def test_closed_monitor_calls_no_extension(mon: StepMonitor) -> None:
    counting = mon.extensions.attach(Counting)
    mon.close()
    late = mon.extensions.attach(Breakdown)  # made, never called
    run_steps(mon, 3)
    assert counting.calls == [] and isinstance(late, Breakdown)
