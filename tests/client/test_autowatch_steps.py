"""Where ``gpumon run`` puts step boundaries and phases, from the events its hooks report:
one step per optimizer step, gradient accumulation in one step, a GAN's two optimizers on one
batch as one step once seen, an optimizer's closure (Lightning's) timed as its own phases.

Every case runs on both finders: ``steps.StepFinder`` (the reference) and its C twin in
``gpumon.client.core._hook``, which ``gpumon run`` uses; ``test_both_finders_leave_the_same_steps``
drives the two through the same random events."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpumon.client import StepMonitor
from gpumon.client.autowatch import steps as steps_module
from gpumon.client.autowatch.steps import StepFinder, step_finder
from gpumon.client.core import _hook
from gpumon.client.core.transport import MemoryTransport
from gpumon.client.monitor import IMPLEMENTATION
from gpumon.wire import StepRecord
from tests.helpers import steps_of

FINDERS: dict[str, Callable[..., Any]] = {"python": StepFinder}
if IMPLEMENTATION == "c":  # (not with GPUMON_PURE_PYTHON=1: the C finder needs the C core)
    FINDERS["c"] = _hook.StepFinder


@pytest.fixture
def transport() -> MemoryTransport:
    return MemoryTransport()


@pytest.fixture(params=sorted(FINDERS))
def finder(request: pytest.FixtureRequest, transport: MemoryTransport) -> Iterator[StepFinder]:
    mon = StepMonitor(run="autowatch", transport=transport, rank=0, world=1)
    yield FINDERS[request.param](mon)
    mon.close()


def test_gpumon_run_uses_the_c_finder_on_a_c_core() -> None:
    mon = StepMonitor(run="autowatch", transport=MemoryTransport(), rank=0, world=1)
    assert type(step_finder(mon)) is (_hook.StepFinder if IMPLEMENTATION == "c" else StepFinder)
    mon.close()


def test_the_c_finder_refuses_a_monitor_on_the_python_core(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumon.client import monitor
    from gpumon.client.core import step_core
    monkeypatch.setattr(monitor, "HookCore", step_core.HookCore)
    mon = StepMonitor(run="autowatch", transport=MemoryTransport(), rank=0, world=1)
    with pytest.raises(TypeError, match="core"):
        _hook.StepFinder(mon)
    monkeypatch.setattr(steps_module, "_CStepFinder", None)
    assert type(step_finder(mon)) is StepFinder
    mon.close()


class Batch:
    shape = (16, 8)


def records(finder: StepFinder, transport: MemoryTransport) -> list[StepRecord]:
    finder.monitor.flush()
    return steps_of(transport)


def micro_batch(finder: StepFinder, t: float) -> None:
    finder.fetched(t, t + 0.01, Batch())
    finder.begin("forward")
    finder.end()
    finder.begin("backward")
    finder.end()


def optimizer_step(finder: StepFinder, optimizer: int) -> None:
    finder.optimizer_begin()
    finder.optimizer_end(optimizer)


def test_one_step_per_optimizer_step_with_every_phase(finder: StepFinder, transport: MemoryTransport) -> None:
    for i in range(5):
        micro_batch(finder, float(i))
        optimizer_step(finder, optimizer=1)
    steps = records(finder, transport)
    assert [s.step for s in steps] == [0, 1, 2, 3, 4]
    for s in steps:
        assert set(s.phases_s) == {"data", "forward", "backward", "optimizer"}
        assert s.samples == 16
    assert not finder.in_step


def test_gradient_accumulation_is_one_step_per_four_micro_batches(
    finder: StepFinder, transport: MemoryTransport
) -> None:
    for i in range(12):
        micro_batch(finder, float(i))
        if i % 4 == 3:
            optimizer_step(finder, optimizer=1)
    steps = records(finder, transport)
    assert len(steps) == 3 and all(s.samples == 4 * 16 for s in steps)


def test_a_gan_counts_one_step_a_batch_once_it_has_seen_one(
    finder: StepFinder, transport: MemoryTransport
) -> None:
    discriminator, generator = 1, 2
    for i in range(4):
        micro_batch(finder, float(i))
        optimizer_step(finder, discriminator)
        finder.begin("forward")
        finder.end()
        finder.begin("backward")
        finder.end()
        optimizer_step(finder, generator)
    # The first batch: one step per optimizer (not known yet), then one a batch.
    assert len(records(finder, transport)) == 2 + 3


def test_without_a_dataloader_every_optimizer_step_is_a_step(
    finder: StepFinder, transport: MemoryTransport
) -> None:
    for _ in range(3):
        for optimizer in (1, 2):
            finder.begin("forward")
            finder.end()
            optimizer_step(finder, optimizer)
    assert len(records(finder, transport)) == 6


def test_the_forward_and_backward_of_an_optimizers_closure_are_their_own_phases(
    finder: StepFinder, transport: MemoryTransport
) -> None:
    for i in range(3):
        finder.fetched(float(i), float(i) + 0.01, Batch())
        finder.optimizer_begin()  # optimizer.step(closure), as Lightning calls it
        finder.begin("forward")
        finder.end()
        finder.begin("backward")
        finder.begin("forward")  # a checkpointed block recomputed inside backward
        finder.end()
        finder.end()
        finder.optimizer_end(1)
    steps = records(finder, transport)
    assert len(steps) == 3
    for s in steps:
        assert set(s.phases_s) == {"data", "forward", "backward", "optimizer"}
        assert sum(v for k, v in s.phases_s.items() if k != "data") <= s.duration_s


def test_a_step_left_open_is_not_recorded(finder: StepFinder, transport: MemoryTransport) -> None:
    micro_batch(finder, 0.0)
    optimizer_step(finder, 1)
    micro_batch(finder, 1.0)  # an evaluation after the last optimizer step, say
    finder.close()
    assert len(records(finder, transport)) == 1


def test_driven_by_a_watcher_that_makes_the_steps_only_the_data_wait_is_passed_on(
    finder: StepFinder, transport: MemoryTransport
) -> None:
    # A DeepSpeed engine's watcher opens and closes the steps at its accumulation boundaries.
    finder.driven = True
    mon = finder.monitor
    for i in range(3):
        micro_batch(finder, float(i))
        with mon.step():  # as the watcher would make it
            with mon.phase("forward"):
                pass
            optimizer_step(finder, 1)
    steps = records(finder, transport)
    assert len(steps) == 3 and all("data" in s.phases_s for s in steps)
    assert all(set(s.phases_s) == {"data", "forward"} for s in steps[1:])


def test_a_top_level_forward_stays_open_until_the_backward_so_the_loss_counts_as_forward(
    finder: StepFinder, transport: MemoryTransport
) -> None:
    finder.fetched(0.0, 0.01, Batch())
    finder.begin("forward")
    finder.end()
    time.sleep(0.02)  # the loss, computed outside any module call
    finder.begin("backward")
    finder.end()
    optimizer_step(finder, 1)
    (step,) = records(finder, transport)
    assert step.phases_s["forward"] >= 0.02 and step.phases_s["backward"] < 0.02


def test_a_second_forward_continues_the_one_left_open(finder: StepFinder, transport: MemoryTransport) -> None:
    finder.begin("forward")
    finder.end()
    finder.begin("forward")  # the loss module, or a second model
    time.sleep(0.02)
    finder.end()
    finder.begin("backward")
    finder.end()
    optimizer_step(finder, 1)
    (step,) = records(finder, transport)
    assert step.phases_s["forward"] >= 0.02 and sum(step.phases_s.values()) <= step.duration_s


def test_a_forward_left_open_ends_when_the_next_batch_is_asked_for(
    finder: StepFinder, transport: MemoryTransport
) -> None:
    for i in range(2):  # an evaluation: forwards, no optimizer
        finder.begin("forward")
        finder.end()
        finder.settle()
        time.sleep(0.02)  # waiting for the next batch
        finder.fetched(float(i), float(i) + 0.02, Batch())
    finder.begin("backward")
    finder.end()
    optimizer_step(finder, 1)
    (step,) = records(finder, transport)
    assert step.phases_s["forward"] < 0.02


def test_a_forward_nested_in_the_optimizer_step_resumes_the_optimizer_phase(
    finder: StepFinder, transport: MemoryTransport
) -> None:
    finder.optimizer_begin()  # optimizer.step(closure)
    finder.begin("forward")
    finder.end()
    time.sleep(0.02)  # the optimizer's own work, after the closure's forward
    finder.optimizer_end(1)
    (step,) = records(finder, transport)
    assert step.phases_s["optimizer"] >= 0.02 and step.phases_s["forward"] < 0.02
    assert not finder.lingering and not finder.in_step


class Mapped(dict[str, Any]):
    """A batch as a dict subclass (Hugging Face's ``BatchEncoding`` is a ``UserDict``)."""


BATCHES: list[Any] = [
    Batch(), (Batch(), Batch()), [Batch()], {"input_ids": Batch()}, Mapped(x=[Batch()]),
    [], {}, ((((Batch(),),),),), object(), None, "text",
]


def script_of(rng: random.Random) -> list[tuple[str, int]]:
    """Events as the hooks report them: each begin ended by its own kind of end, nested only
    as a training loop nests them (an optimizer's closure runs a forward and a backward, a
    checkpointed forward is recomputed in backward), batches fetched between them, the odd
    ``settle`` and ``close``."""
    inside = {None: ["forward", "forward", "backward", "optimizer", "custom"],
              "optimizer": ["forward", "backward"], "backward": ["forward"],
              "custom": ["forward", "backward"], "forward": []}
    script: list[tuple[str, int]] = []
    open_: list[str] = []
    for _ in range(rng.randrange(20, 120)):
        roll = rng.random()
        choices = inside[open_[-1] if open_ else None]
        if open_ and (roll < 0.45 or not choices):
            kind = open_.pop()
            script.append(({"forward": "forward_end", "optimizer": "optimizer_end"}.get(kind, "end"),
                           rng.randrange(100)))
        elif roll < 0.65 or open_:
            kind = rng.choice(choices)
            open_.append(kind)
            event = {"forward": rng.choice(["forward", "forward_begin"]), "optimizer": "optimizer_begin"}
            script.append((event.get(kind, kind), 0))
        else:
            script.append((rng.choice(["fetched"] * 6 + ["exhausted", "settle", "close"]),
                           rng.randrange(100)))
    return script


def play(finder: Any, script: list[tuple[str, int]]) -> list[tuple[bool, bool]]:
    """Drive ``finder`` through ``script``; its state after each event."""
    seen = []
    for i, (event, arg) in enumerate(script):
        if event in ("fetched", "exhausted"):
            finder.fetched(float(i), float(i) + 0.001, BATCHES[arg % len(BATCHES)], event == "fetched")
        elif event == "forward":
            finder.begin("forward")
        elif event == "backward":
            finder.backward_begin()
        elif event == "custom":
            finder.begin("eval")
        elif event == "optimizer_end":
            finder.optimizer_end(1 + arg % 3)
        else:
            getattr(finder, event)()
        seen.append((finder.in_step, finder.lingering))
    return seen


@pytest.mark.skipif(IMPLEMENTATION != "c", reason="the C finder needs the C core")
def test_both_finders_leave_the_same_steps() -> None:
    recorded = counted = 0
    for seed in range(60):
        rng = random.Random(seed)
        script = script_of(rng)
        driven_at = rng.randrange(len(script)) if seed % 4 == 0 else None
        results = []
        for make in (StepFinder, _hook.StepFinder):
            transport = MemoryTransport()
            mon = StepMonitor(run="autowatch", transport=transport, rank=0, world=1)
            finder = make(mon)
            state = play(finder, script[:driven_at])
            if driven_at is not None:
                finder.driven = True
                state += play(finder, script[driven_at:])
            finder.close()
            mon.flush()
            steps = [(s.step, sorted(s.phases_s), s.samples) for s in steps_of(transport)]
            results.append((state, steps, finder.in_step, finder.lingering))
            mon.close()
        assert results[0] == results[1], f"seed {seed}"
        recorded += len(results[0][1])
        counted += sum(1 for _, _, samples in results[0][1] if samples)
    assert recorded > 150 and counted > 40  # the scripts reach what is compared
