"""The hook's stall watch: its rule on a fake clock, the place it reads from a real blocked
thread, the collectives in flight, and the cores' open phase."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import Any

import pytest

from gpumon.client.core import progress as progress_module
from gpumon.client.core import step_core
from gpumon.client.core.comm_inflight import InFlightCollectives
from gpumon.client.core.progress import ProgressEvents
from gpumon.client.core.stall import STALL_AFTER_ENV, StallWatch, is_own_code, read_stack, stall_after_min_s
from gpumon.wire import StateRecord, decode_datagram, encode_record

if sys.platform == "linux":
    from gpumon.client.core import _hook

    CORES = [step_core.HookCore, _hook.HookCore]
else:  # pragma: no cover
    CORES = [step_core.HookCore]


class FakeCore:
    def __init__(self) -> None:
        self.steps = 0
        self.open_phase: str | None = None


def watch(min_s: float = 1.0, in_flight: InFlightCollectives | None = None) -> tuple[
        StallWatch, FakeCore, list[StateRecord]]:
    core = FakeCore()
    sent: list[StateRecord] = []
    w = StallWatch(core, "r", 1, 4242, sent.append, min_s=min_s,
                   in_flight=in_flight or InFlightCollectives())
    return w, core, sent


def run(w: StallWatch, core: FakeCore, start_s: float, end_s: float, step_every_s: float | None,
        tick_s: float = 0.25) -> float:
    """Tick every ``tick_s`` from ``start_s`` to ``end_s``, a step ending every ``step_every_s``."""
    t = start_s
    next_step = start_s + (step_every_s or 0.0)
    while t < end_s:
        t += tick_s
        while step_every_s is not None and next_step <= t:
            core.steps += 1
            next_step += step_every_s
        w.tick(t, 1_700_000_000.0 + t)
    return t


def stalled(sent: list[StateRecord]) -> list[StateRecord]:
    return [r for r in sent if r.state == "stalled"]


def test_a_steady_rank_only_says_it_is_alive() -> None:
    w, core, sent = watch()
    run(w, core, 0.0, 60.0, 0.1)
    assert not stalled(sent)
    assert {r.state for r in sent} == {"stepping"}
    assert 10 <= len(sent) <= 13  # one heartbeat every 5 s
    assert w.threshold_s() == pytest.approx(1.0, rel=0.3)  # steps seen at the ticks' 0.25 s


def test_a_rank_that_stops_is_stalled_after_its_threshold_and_reported_again() -> None:
    w, core, sent = watch(min_s=1.0)
    t = run(w, core, 0.0, 10.0, 0.2)
    core.open_phase = "data"
    stop = t
    run(w, core, t, t + 8.0, None)
    reports = stalled(sent)
    assert reports, "never reported"
    first = reports[0]
    # threshold: 10 typical steps of 0.2 s, as seen from ticks every 0.25 s (2-2.5 s);
    # reported at the first tick after it
    assert 2.0 <= first.t - (1_700_000_000.0 + stop) <= 2.75
    assert first.phase == "data" and first.steps == core.steps
    assert first.since == pytest.approx(1_700_000_000.0 + stop, abs=0.3)
    assert first.threshold_s is not None and 2.0 <= first.threshold_s <= 2.5
    assert 3 <= len(reports) <= 4  # again every 2 s while it lasts
    core.steps += 1
    w.tick(t + 8.25, 1_700_000_000.0 + t + 8.25)
    assert sent[-1].state == "stepping"


def test_one_slow_step_of_a_few_typical_ones_is_not_a_stall() -> None:
    w, core, sent = watch(min_s=0.5)
    t = run(w, core, 0.0, 20.0, 0.25)
    t = run(w, core, t, t + 1.5, None)  # one step of 6 typical ones (a checkpoint)
    run(w, core, t, t + 20.0, 0.25)
    assert not stalled(sent)


def test_a_rank_stepping_every_five_seconds_is_reported_within_a_minute() -> None:
    w, core, sent = watch(min_s=20.0)
    t = run(w, core, 0.0, 100.0, 5.0)
    run(w, core, t, t + 60.0, None)
    reports = stalled(sent)
    assert reports and reports[0].t - 1_700_000_000.0 - t <= 60.0
    # and a checkpoint of 5 s every 50 steps of 0.2 s is never one with the default floor
    w, core, sent = watch(min_s=20.0)
    t = 0.0
    for _ in range(4):
        t = run(w, core, t, t + 10.0, 0.2)
        t = run(w, core, t, t + 5.0, None)
    assert not stalled(sent)


def test_nothing_is_stalled_before_the_first_step_or_after_close() -> None:
    w, core, sent = watch(min_s=0.5)
    run(w, core, 0.0, 30.0, None)
    assert not stalled(sent)
    core.steps = 1
    w.tick(30.25, 1_700_000_030.25)
    w.close(30.5, 1_700_000_030.5)
    run(w, core, 30.5, 60.0, None)
    assert sent[-1].state == "closed" and not stalled(sent)


def test_the_bad_floor_in_the_environment_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STALL_AFTER_ENV, "3.5")
    assert stall_after_min_s() == 3.5
    for bad in ("soon", "-1", "nan", "0"):
        monkeypatch.setenv(STALL_AFTER_ENV, bad)
        assert stall_after_min_s() == 20.0


def read_shard(gate: threading.Event, entered: threading.Event) -> None:
    entered.set()
    gate.wait()


def test_the_place_is_the_training_threads_innermost_own_frame_and_the_collective() -> None:
    gate, entered = threading.Event(), threading.Event()
    thread = threading.Thread(target=read_shard, args=(gate, entered), daemon=True)
    thread.start()
    entered.wait()
    in_flight = InFlightCollectives()
    in_flight.begin("broadcast", 8)
    seq = in_flight.begin("all_reduce", 4096)
    in_flight.end(1)
    w, core, sent = watch(min_s=0.5, in_flight=in_flight)
    w.training_thread = thread.ident
    core.open_phase = "data"
    t = run(w, core, 0.0, 2.0, 0.05)
    run(w, core, t, t + 1.0, None)
    gate.set()
    report = stalled(sent)[0]
    assert report.location is not None
    assert (report.location.file.endswith("test_stall.py") and report.location.function == "read_shard")
    assert report.stack[0].file.endswith("threading.py") and not report.stack[0].own
    assert report.in_flight is not None
    assert (report.in_flight.op, report.in_flight.seq, report.in_flight.nbytes) == ("all_reduce", seq, 4096)
    assert report.launched == 2
    [decoded] = decode_datagram(b"[" + encode_record(report) + b"]").records
    assert decoded == report


def test_a_deep_stack_is_cut_to_fit_a_datagram() -> None:
    def deep(n: int, gate: threading.Event, entered: threading.Event) -> None:
        if n:
            deep(n - 1, gate, entered)
        else:
            read_shard(gate, entered)

    gate, entered = threading.Event(), threading.Event()
    thread = threading.Thread(target=deep, args=(200, gate, entered), daemon=True)
    thread.start()
    entered.wait()
    frame = sys._current_frames()[thread.ident]  # type: ignore[index]
    stack = read_stack(frame)
    gate.set()
    assert len(stack) == 48 and [f.function for f in stack[:3]] == [
        "Condition.wait", "Event.wait", "read_shard"]
    assert not is_own_code(threading.__file__) and not is_own_code("<frozen runpy>")
    assert is_own_code(__file__)


class Event:
    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed


def test_a_collective_on_the_gpu_stays_in_flight_until_its_event_passed() -> None:
    in_flight = InFlightCollectives()
    seq = in_flight.begin("all_reduce", 64)
    event = Event()
    in_flight.queued_on_device(seq, event)
    op = in_flight.oldest()
    assert op is not None and op.on_device and op.seq == seq
    event.passed = True
    assert in_flight.oldest() is None
    assert in_flight.launched == 1


@pytest.mark.parametrize("core_class", CORES)
def test_both_cores_tell_the_open_phase(core_class: Any) -> None:
    seen: list[object] = []
    core = core_class(deque(), lambda: None, lambda exc, step: None, lambda name: name == "data")

    def items() -> Any:
        seen.append(core.open_phase)  # read while the loader waits for this item
        yield 1

    assert core.open_phase is None
    for _ in core.loader(items()):
        assert core.open_phase is None
        with core.step():
            with core.phase("forward"):
                with core.phase("inner"):
                    assert core.open_phase == "forward"
            assert core.open_phase is None
            with core.phase("backward"):
                assert core.open_phase == "backward"
    assert seen == ["data"]
    assert core.open_phase is None


class Events:
    """A fake progress count: ``moving`` says whether the rank makes progress outside steps
    (a module call or a collective between two ticks); ``armed`` whether the probe is in."""

    def __init__(self) -> None:
        self.moving = True
        self.events = 0
        self.armed = False

    def count(self) -> int:
        if self.moving:
            self.events += 1
        return self.events

    def arm(self, thread: int | None) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False


def test_a_rank_progressing_outside_steps_is_evaluating_until_it_stops_moving() -> None:
    events = Events()
    core = FakeCore()
    sent: list[StateRecord] = []
    w = StallWatch(core, "r", 1, 4242, sent.append, min_s=20.0, in_flight=InFlightCollectives(),
                   progress=events)
    t = run(w, core, 0.0, 20.0, 0.2)
    assert not events.armed  # a stepping rank never has the probe in
    eval_start = t
    t = run(w, core, t, t + 120.0, None)  # two minutes of evaluation: forwards, no step
    assert events.armed
    assert not stalled(sent)
    evaluating = [r for r in sent if r.state == "evaluating"]
    assert evaluating and 20.0 <= evaluating[0].t - (1_700_000_000.0 + eval_start) <= 20.5
    assert w.state == "evaluating"
    events.moving = False  # a forward that never returns
    stuck = t
    run(w, core, t, t + 25.0, None)
    first = stalled(sent)[0]
    assert 20.0 <= first.t - (1_700_000_000.0 + stuck) <= 20.5  # the threshold
    core.steps += 1  # training again
    w.tick(t + 25.25, 1_700_000_000.0 + t + 25.25)
    assert sent[-1].state == "stepping" and w.state == "stepping"
    assert not events.armed  # taken out as soon as it steps


def test_a_rank_blocked_in_user_code_is_stalled_not_evaluating() -> None:
    events = Events()
    events.moving = False
    core = FakeCore()
    sent: list[StateRecord] = []
    w = StallWatch(core, "r", 1, 4242, sent.append, min_s=20.0, in_flight=InFlightCollectives(),
                   progress=events)
    t = run(w, core, 0.0, 20.0, 0.2)
    run(w, core, t, t + 21.0, None)
    assert not [r for r in sent if r.state == "evaluating"]
    assert 20.0 <= stalled(sent)[0].t - (1_700_000_000.0 + t) <= 20.5
    w.close(t + 21.5, 1_700_000_000.0 + t + 21.5)
    assert not events.armed


def _forwards_counted(progress: ProgressEvents, thread: threading.Thread, looks: int = 20) -> int:
    """How many of ``looks`` wake-ups (20 ms apart, the probe armed at each) saw the count move."""
    moved = 0
    last = progress.count()
    for _ in range(looks):
        progress.arm(thread.ident)
        time.sleep(0.02)
        now = progress.count()
        moved += now != last
        last = now
    progress.disarm()
    return moved


def test_the_probe_counts_cheap_forwards_between_host_waits_and_not_a_forward_that_never_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The shape of a GPU evaluation: a forward that returns at once, then the thread waits on
    the host outside any module call (a sample of its stack would almost never land in the
    forward; the count cannot miss it)."""
    torch = pytest.importorskip("torch")
    # other tests may have compiled code in this process: this one is a job that compiles nothing
    monkeypatch.setattr(progress_module, "torch_compiled", lambda: False)
    gate, entered, done = threading.Event(), threading.Event(), threading.Event()

    class Stuck(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            entered.set()
            gate.wait()
            return x

    def evaluate() -> None:
        model = torch.nn.Linear(8, 8)
        v = torch.randn(4, 8)
        with torch.no_grad():
            while not done.is_set():
                model(v)
                time.sleep(0.05)  # the wait in .item() or a metric's sync

    progress = ProgressEvents(InFlightCollectives())
    busy = threading.Thread(target=evaluate, daemon=True)
    busy.start()
    stuck = threading.Thread(target=lambda: Stuck()(torch.zeros(1)), daemon=True)
    stuck.start()
    entered.wait()
    try:
        assert _forwards_counted(progress, busy) >= 5  # a forward every 50 ms, looks every 20 ms
        before = progress.count()
        assert _forwards_counted(progress, stuck) == 0
        assert _forwards_counted(progress, threading.main_thread()) == 0  # another thread's calls are not
        assert progress.count() == before
    finally:
        done.set()
        gate.set()
    assert not progress.armed
    # armed, the probe is torch's one global hook, and it takes itself out at its first call
    from torch.nn.modules import module

    others = len(module._global_forward_pre_hooks)  # (a monitor another test left open may hold one)
    progress.arm(threading.get_ident())
    assert progress.armed and len(module._global_forward_pre_hooks) == others + 1
    torch.nn.Linear(2, 2)(torch.zeros(2))
    assert not progress.armed and len(module._global_forward_pre_hooks) <= others
    assert progress.module_calls >= 1


def test_the_probe_stays_out_of_a_process_that_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setattr(progress_module, "torch_compiled", lambda: True)
    progress = ProgressEvents(InFlightCollectives())
    progress.arm(threading.get_ident())
    assert not progress.armed


def test_collectives_launched_count_as_progress() -> None:
    in_flight = InFlightCollectives()
    progress = ProgressEvents(in_flight)
    before = progress.count()
    in_flight.end(in_flight.begin("all_reduce", 8))
    assert progress.count() == before + 1
    progress.noted += 1  # (as gpumon run's model-call wrapper notes a call)
    assert progress.count() == before + 2
