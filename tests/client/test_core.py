"""The hook's hot path in C (``gpumon.client._hook``) against its pure-Python reference
(``gpumon.client._core``): the same calls must leave the same records and state.

Both cores are driven directly here, with a stand-in CUDA clock (events are plain objects,
the allocator statistics a counter), since no GPU runs here. The rest of the client tests run
against whichever core ``StepMonitor`` uses; ``test_client_tests_pass_on_the_pure_python_core``
runs them again with ``GPUMON_PURE_PYTHON=1``.
"""

from __future__ import annotations

import gc
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

from gpumon.client import _core
from gpumon.client.monitor import IMPLEMENTATION

_hook = pytest.importorskip("gpumon.client._hook") if sys.platform != "linux" else None
if _hook is None:
    from gpumon.client import _hook  # on Linux it must have been built: a missing build fails

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    """Stands in for ``_cuda.CudaClock``: numbered events, and memory whose OOM count grows."""

    def __init__(self) -> None:
        self.events = 0
        self.reads = 0

    def event(self) -> str:
        self.events += 1
        return f"event{self.events}"

    def memory(self) -> tuple[int, int, int, int, int]:
        self.reads += 1
        return (100 * self.reads, 200, 150, 0, self.reads // 3)


def make_core(base: type) -> Any:
    """A core of ``base`` with the three methods a subclass provides, logging their calls."""

    class Core(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(deque(maxlen=8))
            self.calls: list[tuple[Any, ...]] = []

        def _detect_cuda(self, final: bool) -> None:
            self.calls.append(("detect", final))
            self._cuda_checked = True

        def _step_failed(self, exc: BaseException | None, step: int | None) -> None:
            self.calls.append(("failed", type(exc).__name__, step))
            self._phases = {}
            self._marks = []
            self._pending_t0 = None

        def _new_phase(self, name: str) -> Any:
            if not name.isidentifier():
                raise ValueError(name)
            ctx = self._phase_cache[name] = self._phase_type(self, name, name == "data")
            return ctx

    Core._phase_type = _hook.Phase if base is _hook.HookCore else _core.Phase  # type: ignore[attr-defined]
    return Core()


CORES = [pytest.param(_core.HookCore, id="python"), pytest.param(_hook.HookCore, id="c")]


def normalised(core: Any) -> list[tuple[Any, ...]]:
    """The buffered records with times replaced by checks: durations positive, each phase
    within its step, and the phase names in order."""
    out = []
    for seq, step, t0, t1, phases, samples, tokens, flops, mem, marks, _measured in core._buffer:
        assert isinstance(t0, float) and isinstance(t1, float) and t0 <= t1
        assert all(0.0 <= s <= t1 - t0 for s in phases.values()), phases
        out.append((seq, step, list(phases), samples, tokens, flops, mem, marks))
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
    core._cuda = FakeClock()
    core._share_gap_s = 1.0  # adjacent phases always share here, however slow the machine
    for _ in range(4):
        with core.step():
            with core.phase("data"):  # host clock even with CUDA
                pass
            with core.phase("forward"):
                pass
            with core.phase("backward"):  # starts at forward's end event
                pass


@pytest.mark.parametrize("base", CORES)
def test_scenario_records(base: type) -> None:
    core = make_core(base)
    scenario(core)
    records = normalised(core)
    # Nine steps were recorded (the failed one is not); the deque keeps the last eight.
    assert core._seq == 9
    assert [r[0] for r in records] == list(range(1, 9))
    assert records[0][1:7] == (None, ["data", "forward", "backward"], 8, 16, 1.5e9, None)
    assert records[3][1:] == (41, ["comm"], None, None, None, {"allocated": 5}, None)
    assert [r[1] for r in records[4:]] == [None] * 4
    assert core.calls == [("detect", True), ("failed", "KeyError", 42)]
    assert core._step_depth == 0 and core._phase_depth == 0 and core._pending_t0 is None
    assert core._cuda.reads == 4 and core._last_ooms == 1


def test_both_cores_leave_the_same_records() -> None:
    python, c = make_core(_core.HookCore), make_core(_hook.HookCore)
    scenario(python)
    scenario(c)
    assert normalised(c) == normalised(python)
    assert (c._seq, c.calls, c._last_ooms) == (python._seq, python.calls, python._last_ooms)
    # The deque kept the last 8 of 10 steps: the CUDA ones carry marks and allocator tuples.
    last = normalised(c)[-1]
    assert last[2] == ["data", "forward", "backward"]
    assert last[6] == (400, 200, 150, 0, 1)
    assert last[7] == [("forward", "event10", "event11"), ("backward", "event11", "event12")]


@pytest.mark.parametrize("base", CORES)
def test_loader_counts_waits_and_ends_like_a_generator(base: type) -> None:
    core = make_core(base)

    def slow() -> Iterator[int]:
        for i in range(2):
            time.sleep(0.01)
            yield i
        raise OSError("disk gone")

    loader = core.loader(slow())
    assert next(loader) == 0
    assert core._phases["data"] >= 0.01 and core._pending_t0 is not None
    assert next(loader) == 1
    assert core._phases["data"] >= 0.02
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
def test_a_held_step_object_keeps_its_counts(base: type) -> None:
    core = make_core(base)
    first = core.step(samples=1)
    second = core.step(samples=2)  # must not reuse the object still held as `first`
    with first:
        pass
    with second:
        pass
    assert [r[3] for r in normalised(core)] == [1, 2]


@pytest.mark.parametrize("base", CORES)
def test_counts_can_be_set_on_an_open_step(base: type) -> None:
    core = make_core(base)
    step = core.step()
    step.__enter__()
    step._samples, step._tokens, step._flops = 3, 4, 5.0
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
    assert core._step_depth == 0 and not core._buffer


def test_c_state_attributes_keep_their_types() -> None:
    core = make_core(_hook.HookCore)
    with pytest.raises(TypeError):
        core._phases = None
    with pytest.raises(TypeError):
        core._marks = ()
    core._pending_t0 = 1.5
    assert core._pending_t0 == 1.5
    core._pending_t0 = None
    assert core._pending_t0 is None


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
        core._buffer.clear()


def test_c_core_leaks_nothing() -> None:
    core = make_core(_hook.HookCore)
    core._cuda = FakeClock()
    run_steps(core, 1000)
    gc.collect()
    before = len(gc.get_objects())
    run_steps(core, 20000)
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    # The core, its reused step object and its phase objects refer to each other: the
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
    """Stands in for ``_extensions.StepExtensions``: logs the calls, numbers the fields."""

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
    core._set_extensions(extensions)
    with core.step():
        with core.step():
            pass
    with pytest.raises(KeyError):
        with core.step():
            raise KeyError("boom")
    core._set_extensions(None)
    with core.step():
        pass
    assert extensions.calls == ["begin", ("end", True), "begin", ("end", False)]
    assert [r[-1] for r in core._buffer] == [None, {"memb": {"other": 2}}, None]


def test_both_cores_pass_the_same_extension_fields() -> None:
    python, c = make_core(_core.HookCore), make_core(_hook.HookCore)
    logs = []
    for core in (python, c):
        logs.append(LoggedExtensions())
        core._set_extensions(logs[-1])
        scenario(core)
    assert logs[0].calls == logs[1].calls
    assert [r[-1] for r in python._buffer] == [r[-1] for r in c._buffer]
    assert normalised(c) == normalised(python)


def test_c_core_with_extensions_leaks_nothing() -> None:
    core = make_core(_hook.HookCore)
    core._set_extensions(LoggedExtensions())
    run_steps(core, 1000)
    core._set_extensions(extensions := LoggedExtensions())
    gc.collect()
    before = len(gc.get_objects())
    run_steps(core, 20000)
    extensions.calls.clear()
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    ref = weakref.ref(core)
    del core
    gc.collect()
    assert ref() is None
