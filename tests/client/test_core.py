"""The hook's hot path in C (``gpumon.client.core._hook``) against its pure-Python reference
(``gpumon.client.core.step_core``): the same calls must leave the same records and state.

Both cores are driven directly here, with a stand-in CUDA clock (events are plain objects,
the allocator statistics a counter), since no GPU runs here. The rest of the client tests run
against whichever core ``StepMonitor`` uses; ``test_client_tests_pass_on_the_pure_python_core``
runs them again with ``GPUMON_PURE_PYTHON=1``.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumon.client import StepMonitor, monitor
from gpumon.client.core import step_core
from gpumon.client.core.step_tuple import StepFields
from gpumon.client.core.transport import MemoryTransport
from gpumon.client.monitor import IMPLEMENTATION
from gpumon.wire import EventRecord, MemoryStats, StateRecord, StepRecord
from gpumon.wire.records import MEM_WIRE_NAMES
from tests.client.conftest import ManualClock

_hook = pytest.importorskip("gpumon.client.core._hook") if sys.platform != "linux" else None
if _hook is None:
    from gpumon.client.core import _hook  # on Linux it must have been built: a missing build fails

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    """Stands in for ``cuda_clock.CudaClock``: numbered events, and memory whose OOM count grows."""

    share_gap_s = 1.0  # adjacent phases always share here, however slow the machine
    device_interval_s = 0.0  # every step is timed on the GPU unless a test says otherwise

    def __init__(self) -> None:
        self.events = 0
        self.reads = 0

    def event(self) -> str:
        self.events += 1
        return f"event{self.events}"

    def memory(self) -> tuple[int, ...]:
        self.reads += 1
        stats = {"allocated": 100 * self.reads, "reserved": 200, "peak": 150, "retries": 0,
                 "ooms": self.reads // 3}  # built in the wire's order: the cores read ooms by it
        return tuple(stats[name] for name in MEM_WIRE_NAMES)


class Harness:
    """A core of ``base`` as the monitor holds one: its buffer, and the three callbacks,
    logging their calls."""

    def __init__(self, base: type) -> None:
        self.buffer: deque[Any] = deque(maxlen=8)
        self.calls: list[tuple[Any, ...]] = []
        self.core = base(self.buffer, self.first_step, self.step_failed, self.phase_clock)

    def first_step(self) -> None:
        self.calls.append(("detect", True))

    def step_failed(self, exc: BaseException | None, step: int | None) -> None:
        self.calls.append(("failed", type(exc).__name__, step))

    def phase_clock(self, name: str) -> bool:
        if not name.isidentifier():
            raise ValueError(name)
        return name == "data"


def make_core(base: type) -> Any:
    """A core of ``base``; its harness is ``harness_of(core)``."""
    harness = Harness(base)
    _harnesses[id(harness.core)] = harness
    return harness.core


_harnesses: weakref.WeakValueDictionary[int, Harness] = weakref.WeakValueDictionary()


def harness_of(core: Any) -> Harness:
    return _harnesses[id(core)]


CORES = [pytest.param(step_core.HookCore, id="python"), pytest.param(_hook.HookCore, id="c")]


def records_of(core: Any) -> list[StepFields]:
    """The core's buffered step tuples, read by ``StepFields``' names."""
    return [StepFields._make(item) for item in harness_of(core).buffer]


def normalised(core: Any) -> list[tuple[Any, ...]]:
    """The buffered records with times replaced by checks: durations positive, each phase
    within its step, and the phase names in order."""
    out = []
    for r in records_of(core):
        assert isinstance(r.t0, float) and isinstance(r.t1, float) and r.t0 <= r.t1
        assert all(0.0 <= s <= r.t1 - r.t0 for s in r.phases.values()), r.phases
        out.append((r.seq, r.step, list(r.phases), r.samples, r.tokens, r.flops, r.memory, r.marks))
    return out


def scenario(core: Any) -> None:
    """Every path of the hot code: loader waits, nested steps and phases, phases before a
    step, repeated phases, counts, caller step numbers, a failed step, CUDA marks."""
    data = iter(range(4))
    for _ in core.loader(data):
        with core.step(samples=8, tokens=16, flops=1.5e9):
            with core.phase("forward"):
                with core.phase("inner"):  # nested: only the outermost is timed
                    pass
            with core.step():  # nested step: only the outermost counts
                pass
            with core.phase("backward"):
                pass
            with core.phase("backward"):
                pass
    with core.phase("comm"):  # before a step: belongs to the next one
        pass
    with core.step(step=41, memory={"allocated": 5}):
        pass
    with pytest.raises(KeyError):
        with core.step(step=42):
            with core.phase("forward"):
                raise KeyError("boom")
    core.set_cuda(FakeClock())
    for _ in range(4):
        with core.step():
            with core.phase("data"):  # host clock even with CUDA
                pass
            with core.phase("forward"):
                pass
            with core.phase("backward"):  # starts at forward's end event
                pass


def assert_at_rest(core: Any) -> None:
    """No step or phase is open and nothing is pending: a probe step records exactly its
    own phase, timed, in a window that starts when its block is entered."""
    assert not core.in_step
    buffer = harness_of(core).buffer
    before = time.perf_counter()
    with core.step():
        with core.phase("probe"):
            pass
    probe = StepFields._make(buffer.pop())
    assert list(probe.phases) == ["probe"] and probe.t0 >= before
    assert probe.seq == core.steps - 1


@pytest.mark.parametrize("base", CORES)
def test_scenario_records(base: type) -> None:
    core = make_core(base)
    scenario(core)
    records = normalised(core)
    # Nine steps were recorded (the failed one is not); the deque keeps the last eight.
    assert core.steps == 9
    assert [r[0] for r in records] == list(range(1, 9))
    assert records[0][1:7] == (None, ["data", "forward", "backward"], 8, 16, 1.5e9, None)
    assert records[3][1:] == (41, ["comm"], None, None, None, {"allocated": 5}, None)
    assert [r[1] for r in records[4:]] == [None] * 4
    assert harness_of(core).calls == [("detect", True), ("failed", "KeyError", 42)]
    assert core.last_ooms == 1
    assert_at_rest(core)


class FixedFields:
    """Stands in for ``extensions.StepExtensions``: the same measured fields every step."""

    def begin(self) -> None:
        pass

    def end(self, recorded: bool) -> dict[str, object] | None:
        return {"cpu_wait": 0.25}


@pytest.mark.parametrize("base", CORES)
def test_each_core_appends_the_fields_step_fields_names(base: type) -> None:
    """``StepFields`` is the one definition of the step tuple: each core's tuple has its
    length, and each field where it says, with and without CUDA."""
    core = make_core(base)
    core.set_extensions(FixedFields())
    before = time.perf_counter()
    with core.step(samples=3, tokens=5, flops=7.5, step=41, memory={"allocated": 9}):
        with core.phase("forward"):
            pass
    after = time.perf_counter()
    core.set_cuda(FakeClock())
    with core.step(samples=4):
        with core.phase("forward"):
            pass
    host, device = harness_of(core).buffer
    assert type(host) is tuple and len(host) == len(device) == len(StepFields._fields)
    first = StepFields._make(host)
    assert (first.seq, first.step, first.samples, first.tokens, first.flops) == (0, 41, 3, 5, 7.5)
    assert before <= first.t0 <= first.t1 <= after and list(first.phases) == ["forward"]
    assert first.memory == {"allocated": 9} and first.marks is None
    assert first.measured == {"cpu_wait": 0.25}
    second = StepFields._make(device)
    assert (second.seq, second.step, second.samples, second.tokens, second.flops) == (1, None, 4, None, None)
    assert second.memory == (100, 200, 150, 0, 0)
    assert second.marks == [("forward", "event1", "event2")]


def test_both_cores_leave_the_same_records() -> None:
    python, c = make_core(step_core.HookCore), make_core(_hook.HookCore)
    scenario(python)
    scenario(c)
    assert normalised(c) == normalised(python)
    assert (c.steps, harness_of(c).calls, c.last_ooms) == (
        python.steps, harness_of(python).calls, python.last_ooms)
    # The deque kept the last 8 of 10 steps: the CUDA ones carry marks and allocator tuples.
    last = normalised(c)[-1]
    assert last[2] == ["data", "forward", "backward"]
    assert last[6] == (400, 200, 150, 0, 1)
    assert last[7] == [("forward", "event10", "event11"), ("backward", "event11", "event12")]


@pytest.mark.parametrize("base", CORES)
def test_loader_counts_waits_and_ends_like_a_generator(base: type) -> None:
    core = make_core(base)

    asked: list[float] = []

    def slow() -> Iterator[int]:
        for i in range(2):
            asked.append(time.perf_counter())
            time.sleep(0.01)  # at least 10 ms on the monotonic clock both read
            yield i
        raise OSError("disk gone")

    loader = core.loader(slow())
    started = time.perf_counter()
    assert next(loader) == 0
    assert next(loader) == 1
    with core.step():  # both waits are this step's data phase, and its window starts with them
        pass
    last = records_of(core)[-1]
    t0, t1, phases = last.t0, last.t1, last.phases
    # Orderings of the clock's own readings, and sleeps' lower bounds: true however slow the
    # machine is.
    assert started <= t0 <= asked[0] and phases["data"] >= 0.02 and t1 - t0 >= phases["data"]
    with pytest.raises(OSError, match="disk gone"):
        next(loader)
    with pytest.raises(StopIteration):
        next(loader)
    assert list(core.loader([])) == []


@pytest.mark.parametrize("base", CORES)
def test_loader_calls_iter_at_the_first_next(base: type) -> None:
    core = make_core(base)
    calls = []

    class Lazy:
        def __iter__(self) -> Iterator[int]:
            calls.append("iter")
            return iter([1])

    loader = core.loader(Lazy())
    assert calls == []
    assert list(loader) == [1] and calls == ["iter"]


@pytest.mark.parametrize("base", CORES)
def test_the_step_origin_is_the_reading_its_record_starts_from(base: type) -> None:
    core = make_core(base)
    assert core.step_origin is None
    with core.step():
        plain = core.step_origin
    with core.phase("data"):  # timed work before a step opens the next record
        pass
    with core.step():
        after_data = core.step_origin
        with core.phase("forward"):
            assert core.step_origin == after_data
    assert core.step_origin is None
    first, second = records_of(core)
    assert (first.t0, second.t0) == (plain, after_data)
    assert second.t1 - second.t0 > second.phases["forward"]


@pytest.mark.parametrize("base", CORES)
def test_a_held_step_object_keeps_its_counts(base: type) -> None:
    core = make_core(base)
    first = core.step(samples=1)
    second = core.step(samples=2)
    with first:
        pass
    with second:
        pass
    assert [r[3] for r in normalised(core)] == [1, 2]


@pytest.mark.parametrize("base", CORES)
def test_every_call_makes_a_new_step_object(base: type) -> None:
    # Both cores agree: no reuse, so nothing a caller keeps can change under it.
    core = make_core(base)
    with core.step(samples=1) as a:
        pass
    with core.step(samples=2) as b:
        pass
    assert a is not b
    assert [r[3] for r in normalised(core)] == [1, 2]


@pytest.mark.parametrize("base", CORES)
def test_counts_can_be_set_on_an_open_step(base: type) -> None:
    core = make_core(base)
    step = core.step()
    step.__enter__()
    step.set_counts(3, 4, 5.0)
    step.__exit__(None, None, None)
    assert normalised(core)[0][3:6] == (3, 4, 5.0)


@pytest.mark.parametrize("base", CORES)
def test_bad_calls_are_clear_errors(base: type) -> None:
    core = make_core(base)
    with pytest.raises(TypeError):
        core.step(8)
    with pytest.raises(TypeError):
        core.step(sample=8)
    with pytest.raises(ValueError):
        core.phase("not a label")
    with pytest.raises(TypeError):
        core.phase(["unhashable"])
    assert not core.in_step and not harness_of(core).buffer


@pytest.mark.parametrize("base", CORES)
def test_a_stopped_core_records_nothing_and_calls_no_extension(base: type) -> None:
    core = make_core(base)
    extensions = LoggedExtensions()
    core.set_extensions(extensions)
    core.stop()
    with core.step():
        pass
    assert core.steps == 1 and not harness_of(core).buffer and extensions.calls == []


def test_both_cores_offer_the_same_surface() -> None:
    """The monitor reaches the core only through these; the C core has no state attributes."""
    def surface(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    expected = {"step", "phase", "loader", "data_wait", "set_cuda", "set_extensions", "set_quiet_until",
                "set_ring", "stop", "steps", "in_step", "last_ooms", "open_phase",
                "step_origin"}
    assert surface(step_core.HookCore) == surface(_hook.HookCore) == expected
    assert not [name for name in dir(_hook.HookCore) if name.startswith("_") and not name.startswith("__")]
    assert surface(step_core.Step) == surface(_hook.Step) == {"set_counts"}
    assert surface(step_core.Phase) == surface(_hook.Phase) == set()


def test_c_clock_is_perf_counter() -> None:
    for _ in range(100):
        before = time.perf_counter()
        now = _hook.perf_counter()
        after = time.perf_counter()
        assert before <= now <= after


def run_steps(core: Any, n: int) -> None:
    for _ in core.loader(range(n)):
        with core.step(samples=1, flops=2.0):
            with core.phase("forward"):
                pass
        harness_of(core).buffer.clear()


@pytest.mark.parametrize("with_extensions", [False, True])
def test_c_core_leaks_nothing(with_extensions: bool) -> None:
    core = make_core(_hook.HookCore)
    core.set_cuda(FakeClock())
    extensions = LoggedExtensions()
    if with_extensions:
        core.set_extensions(extensions)
    run_steps(core, 1000)
    extensions.calls.clear()
    gc.collect()
    before = len(gc.get_objects())
    run_steps(core, 20000)
    extensions.calls.clear()  # what the stand-in logs is not the core's
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    # The core, its step and phase objects and its callbacks refer to each other: the
    # collector must be able to see and break those cycles.
    ref = weakref.ref(core)
    del core
    gc.collect()
    assert ref() is None


def test_monitor_uses_the_c_core_where_it_was_built() -> None:
    assert IMPLEMENTATION == ("python" if os.environ.get("GPUMON_PURE_PYTHON") else "c")


@pytest.mark.skipif(bool(os.environ.get("GPUMON_PURE_PYTHON")), reason="this is that run")
def test_client_tests_pass_on_the_pure_python_core() -> None:
    env = {**os.environ, "GPUMON_PURE_PYTHON": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/client"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]



class LoggedExtensions:
    """Stands in for ``extensions.StepExtensions``: logs the calls, numbers the fields."""

    def __init__(self) -> None:
        self.calls: list[object] = []

    def begin(self) -> None:
        self.calls.append("begin")

    def end(self, recorded: bool) -> dict[str, object] | None:
        self.calls.append(("end", recorded))
        return {"memb": {"other": len(self.calls)}} if recorded else None


@pytest.mark.parametrize("base", CORES)
def test_extensions_are_called_around_outermost_steps_only(base: type) -> None:
    core = make_core(base)
    with core.step():
        pass
    extensions = LoggedExtensions()
    core.set_extensions(extensions)
    with core.step():
        with core.step():
            pass
    with pytest.raises(KeyError):
        with core.step():
            raise KeyError("boom")
    core.set_extensions(None)
    with core.step():
        pass
    assert extensions.calls == ["begin", ("end", True), "begin", ("end", False)]
    assert [r.measured for r in records_of(core)] == [None, {"memb": {"other": 2}}, None]


@pytest.mark.parametrize("base", CORES)
def test_while_the_extensions_are_quiet_a_step_calls_none_of_them(base: type) -> None:
    core = make_core(base)
    extensions = LoggedExtensions()
    core.set_extensions(extensions)
    core.set_quiet_until(time.perf_counter() + 3600)
    with core.step():
        core.set_quiet_until(-math.inf)  # quiet when the step began: its end is not called either
    with core.step():
        core.set_quiet_until(time.perf_counter() + 3600)  # called when it began: so is its end
    with core.step():
        pass
    core.set_quiet_until(time.perf_counter())
    with core.step():
        pass
    assert extensions.calls == ["begin", ("end", True), "begin", ("end", True)]
    assert len(records_of(core)) == 4


def test_both_cores_pass_the_same_extension_fields() -> None:
    python, c = make_core(step_core.HookCore), make_core(_hook.HookCore)
    logs = []
    for core in (python, c):
        logs.append(LoggedExtensions())
        core.set_extensions(logs[-1])
        scenario(core)
    assert logs[0].calls == logs[1].calls
    assert [r.measured for r in records_of(python)] == [r.measured for r in records_of(c)]
    assert normalised(c) == normalised(python)


class CommEveryStep:
    """An extension reporting a count of its calls as a collective's count."""

    def __init__(self) -> None:
        self.n = 0

    def step_begin(self) -> None:
        self.n += 1

    def step_end(self, fields: dict[str, object]) -> None:
        fields["comm"] = {"exposed": 0.0, "busy": 0.0, "ops": {"all_reduce": [self.n, 64, 0.0]}}


def monitor_script(mon: Any) -> None:
    """What a training loop does with a monitor, every path: loader, counts, nested and
    repeated phases, caller step numbers and memory, a failed step, an OOM, an extension."""
    import torch  # scripts/setup installs it: its absence fails
    for batch in mon.loader(range(3)):
        with mon.step(samples=8 + batch, tokens=16, flops=2.5e9):
            with mon.phase("forward"):
                with mon.phase("inner"):
                    pass
            with mon.phase("backward"):
                pass
    mon.extensions.attach(CommEveryStep)
    with mon.phase("comm"):
        pass
    with mon.step(step=41, memory={"allocated": 5, "bogus": 1}):
        pass
    with pytest.raises(KeyError):
        with mon.step(step=42):
            raise KeyError("boom")
    with pytest.raises(torch.OutOfMemoryError):
        with mon.step(step=43):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    with mon.step(samples=-1):
        with mon.phase("optimizer"):
            pass


def comparable(record: Any) -> Any:
    """A record with what depends on the clock replaced by checks on it."""
    if isinstance(record, StepRecord):
        assert record.t_start is not None and record.duration_s >= 0
        assert all(0 <= s <= record.duration_s for s in record.phases_s.values())
        return dataclasses.replace(record, t_start=0.0, duration_s=0.0,
                                   phases_s=dict.fromkeys(record.phases_s, 0.0))
    if isinstance(record, EventRecord):
        return dataclasses.replace(record, t=0.0)
    if isinstance(record, StateRecord):  # the collectives' count is the process's
        return dataclasses.replace(record, t=0.0, since=None, launched=None)
    return record


def test_both_cores_under_a_monitor_send_the_same_records(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = {}
    for name, core in (("python", step_core.HookCore), ("c", _hook.HookCore)):
        monkeypatch.setattr(monitor, "HookCore", core)
        transport = MemoryTransport()
        mon = StepMonitor(run="twins", transport=transport, rank=1, world=2)
        assert type(mon._core) is core
        monitor_script(mon)
        mon.close()
        # How records fell into datagrams depends on when the background flush ran.
        # A heartbeat goes out when the background thread happened to wake: not compared.
        # Any other state record is sent at once, in a datagram of its own, so where it falls
        # among the buffered records depends on whether the sender flushed before it: compared
        # apart, in the order they were sent.
        records = [comparable(r) for r in transport.records()
                   if not (isinstance(r, StateRecord) and r.state == "stepping")]
        sent[name] = ([r for r in records if not isinstance(r, StateRecord)],
                      [r for r in records if isinstance(r, StateRecord)],
                      dataclasses.replace(mon.stats, datagrams_sent=0, state_reports=0))
    (python_records, python_states, python_stats) = sent["python"]
    (c_records, c_states, c_stats) = sent["c"]
    assert c_records == python_records
    assert c_states == python_states
    assert c_stats == python_stats
    steps = [r for r in c_records if isinstance(r, StepRecord)]
    assert [s.step for s in steps] == [0, 1, 2, 41, 4]  # failed steps are not counted
    assert [s.samples for s in steps] == [8, 9, 10, None, None]
    assert [s.comm.ops[0].count if s.comm else None for s in steps] == [None, None, None, 1, 4]
    assert steps[3].mem == MemoryStats(allocated_bytes=5) and set(steps[3].phases_s) == {"comm"}
    [oom] = [r for r in c_records if isinstance(r, EventRecord) and r.event == "oom"]
    assert (oom.event, oom.step) == ("oom", 43)
    assert c_stats.steps == 5 and c_stats.invalid_fields == 2


class SampledClock(FakeClock):
    """A clock whose device interval the test controls: ``device_interval_s`` long."""

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self.device_interval_s = interval_s


def cuda_steps(core: Any, count: int, pause_s: float = 0.0) -> None:
    for _ in range(count):
        with core.phase("data"):
            pass
        with core.step():
            with core.phase("forward"):
                pass
            with core.phase("backward"):
                pass
        if pause_s:
            time.sleep(pause_s)


@pytest.mark.parametrize("base", CORES)
def test_only_one_step_per_device_interval_gets_cuda_events(base: type) -> None:
    core = make_core(base)
    clock = SampledClock(interval_s=3600.0)
    core.set_cuda(clock)
    cuda_steps(core, 5)
    records = records_of(core)
    # The first step is timed on the GPU (and reads the allocator); the next four, inside the
    # interval, on the host clock alone: no event recorded, no statistics read, every phase kept.
    assert [len(r.marks) for r in records] == [2, 0, 0, 0, 0]
    assert [r.memory for r in records] == [(100, 200, 150, 0, 0), None, None, None, None]
    assert clock.events == 3 and clock.reads == 1
    assert all(list(r.phases) == ["data", "forward", "backward"] for r in records)


def sampled_as_the_rule_says(records: list[StepFields], interval_s: float) -> list[bool]:
    """Which steps the rule times on the GPU, from the steps' own end times: the first, then
    the step after the first to end ``interval_s`` or more after the last GPU-timed one ended
    (decided as a step ends, for the next one)."""
    timed, next_t = [], float("-inf")
    device = True
    for r in records:
        timed.append(device)
        if device:
            next_t = r.t1 + interval_s
        device = r.t1 >= next_t
    return timed


def test_the_first_step_after_the_interval_is_timed_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pure-Python core on a clock the test moves: the exact steps.
    clock = ManualClock().install(monkeypatch, "gpumon.client.core.step_core")
    core = make_core(step_core.HookCore)
    sampled = SampledClock(interval_s=1 / 16)  # binary fractions: sums without rounding
    core.set_cuda(sampled)
    for gap_s in (1 / 64, 1 / 32, 1 / 32, 0.0, 1 / 16, 0.0):  # before each step
        clock.advance(gap_s)
        cuda_steps(core, 1)
    # Steps end at 1, 3, 5, 5, 9, 9 (in 64ths of a second): the first is timed, then the one
    # after the step that ends an interval (4/64) after it, then again one interval later.
    assert [len(r.marks) for r in records_of(core)] == [2, 0, 0, 2, 0, 2]
    assert records_of(core) and sampled_as_the_rule_says(records_of(core), 1 / 16) == [
        True, False, False, True, False, True]
    assert sampled.reads == 3
    # A zero interval times every step on the GPU, as before sampling.
    every = make_core(step_core.HookCore)
    every.set_cuda(SampledClock(interval_s=0.0))
    cuda_steps(every, 3)
    assert [len(r.marks) for r in records_of(every)] == [2, 2, 2]


def test_the_c_core_samples_by_the_same_rule() -> None:
    # The C core reads the machine's clock: its own records' end times say which steps the
    # rule times, however long the machine took between them.
    core = make_core(_hook.HookCore)
    core.set_cuda(SampledClock(interval_s=0.05))
    cuda_steps(core, 2)
    time.sleep(0.06)  # at least one interval: a later step is timed again
    cuda_steps(core, 3)
    records = records_of(core)
    assert [bool(r.marks) for r in records] == sampled_as_the_rule_says(records, 0.05)
    assert [bool(r.marks) for r in records].count(True) >= 2


def test_both_cores_sample_the_same_steps() -> None:
    python, c = make_core(step_core.HookCore), make_core(_hook.HookCore)
    for core in (python, c):
        core.set_cuda(SampledClock(interval_s=3600.0))
        cuda_steps(core, 4)
    assert normalised(c) == normalised(python)
    assert [bool(r[7]) for r in normalised(c)] == [True, False, False, False]
