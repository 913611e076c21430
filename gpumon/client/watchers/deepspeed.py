"""A DeepSpeed engine, watched: its phases, its steps, its communication and its memory.

``watch(engine)`` wraps three methods of that one engine (instance attributes over the class's):
``forward`` (what ``engine(...)`` calls), ``backward`` and ``step``, timed as the phases
``forward``, ``backward`` and ``optimizer``. A gpumon step is one optimizer step: one
gradient-accumulation boundary, with the micro-steps before it inside it.

Steps are made for the loop (``StepDriver``) unless it makes its own: the first training forward
(grad enabled, engine in training mode) after a boundary opens a step, the ``step()`` call
that reaches the boundary closes it, and the step's ``samples`` is the sum of its
micro-batches' sizes (the leading dimension of the first tensor passed to ``engine(...)``, else
DeepSpeed's ``train_micro_batch_size_per_gpu``). A loop that wraps its iteration in
``with mon.step(...)`` itself owns its steps from the first one seen on: the engine's phases
fall inside them and no step is made for it (with gradient accumulation that is one gpumon step
per micro-step, unless the block wraps the whole accumulation). A forward outside training
(evaluation, ``torch.no_grad()``) opens nothing, and the engine's methods called outside any
step (evaluation, or work such a loop keeps out of its steps) are timed as no phase: a phase
outside a step would count in the next one. An engine watched from inside its first forward
(``gpumon run`` watches a module as it is first called) starts its first step at that
micro-batch's backward, counted at the configured micro-batch size.

Communication: DeepSpeed's ``deepspeed.comm`` calls ``torch.distributed``'s collectives, which
``comm.tap`` wraps; the two its torch backend bound at ``init_distributed`` (all-gather into a
tensor, reduce-scatter of a tensor) are bound again to the wrapped ones. So ZeRO's
reduce-scatters and all-gathers and the gradient all-reduce, with or without ``overlap_comm``,
are measured as DDP's and FSDP's are (``comm``): exposed and overlapped seconds, bytes, count
and seconds per kind. DeepSpeed's own ``comms_logger`` and ``wall_clock_breakdown`` (which
synchronise) are neither used nor needed.

Memory: what this rank holds under each ZeRO stage (``deepspeed_memory``).

Nothing here raises into the training loop: a wrapped method that fails in gpumon's part runs
the original as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpumon.client.comm.ledger import CommLedger
from gpumon.client.core.batches import batch_size
from gpumon.client.watchers.memory import MemoryBreakdownSampler

if TYPE_CHECKING:
    from gpumon.client.core.seam import Watched
    from gpumon.client.core.step_core import Step

log = logging.getLogger("gpumon.client")

WATCHED_MARK = "_gpumon_watched"
"""Set on an engine once watched: a second ``watch()`` wraps nothing twice."""


def zero_stage(engine: Any) -> int | None:
    """The engine's ZeRO stage (0 with ZeRO off), or None if it cannot be told."""
    try:
        stage = engine.zero_optimization_stage()
    except Exception:
        return None
    return stage if isinstance(stage, int) else None


class StepDriver:
    """The monitor's step extension for a DeepSpeed engine: opens and closes steps at the
    engine's accumulation boundaries, unless the loop opens its own."""

    def __init__(self, monitor: Watched) -> None:
        self._monitor = monitor
        self._step: Step | None = None
        self._opening = False
        self._in_step = False
        self.user_steps = False
        """The loop opened a step itself: it owns the steps from then on."""
        self._samples = 0
        self.steps_made = 0

    def step_begin(self) -> None:
        self._in_step = True
        if not self._opening:
            self.user_steps = True

    def step_end(self, fields: dict[str, object]) -> None:
        self._in_step = False

    @property
    def in_step(self) -> bool:
        """Whether a step (the loop's or one made here) is open."""
        return self._in_step

    def micro_batch(self, engine: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training forward starts: open a step if none is open and the loop makes none;
        count the micro-batch's samples."""
        if self.user_steps:
            return
        size = batch_size(args) if args else batch_size(next(iter(kwargs.values()), None))
        if size is None:
            try:
                size = int(engine.train_micro_batch_size_per_gpu())
            except Exception:
                size = None
        if self._step is None:
            if self._in_step:  # a step the loop opened
                self.user_steps = True
                return
            self._samples = 0
            self._open()
        if size is not None and self._step is not None:
            self._samples += size
            self._step.set_counts(self._samples, None, None)

    def batch(self, samples: int | None) -> None:
        """A pipeline engine's train_batch starts: open its step, ``samples`` in it."""
        if self._step is not None or self._in_step:
            return
        step = self._open()
        if samples is not None:
            step.set_counts(samples, None, None)

    def _open(self) -> Step:
        """Open a step of this driver's own (not the loop's: ``step_begin`` tells them apart)."""
        self._opening = True
        try:
            step = self._monitor.step()
            step.__enter__()
            self._step = step
        finally:
            self._opening = False
        return step

    def boundary(self, exc: BaseException | None = None) -> None:
        """The optimizer step at the accumulation boundary returned (or ``exc`` escaped a
        phase): close the open step."""
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(None if exc is None else type(exc), exc, None)
            self.steps_made += exc is None


def watch_engine(monitor: Watched, engine: Any) -> StepDriver | None:
    """Time ``engine``'s forward, backward and optimizer step into ``monitor`` and make its
    steps; None if the engine's methods could not be wrapped."""
    driver = monitor.extensions.attach(StepDriver, lambda: StepDriver(monitor))
    if getattr(engine, WATCHED_MARK, False):
        return driver
    try:
        forward, backward, step = engine.forward, engine.backward, engine.step
        boundary = _boundary_test(engine)
    except AttributeError as exc:
        log.warning("gpumon: this DeepSpeed engine differs (%s): its phases are not timed", exc)
        return None
    phase = monitor.phase
    extensions = monitor.extensions

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        if _training(engine):
            _safely(driver.micro_batch, engine, args, kwargs)
        if not driver.in_step:  # evaluation, or work the loop keeps out of its steps
            return forward(*args, **kwargs)
        try:
            with phase("forward"):
                return forward(*args, **kwargs)
        except BaseException as exc:
            driver.boundary(exc)
            raise

    def timed_backward(*args: Any, **kwargs: Any) -> Any:
        if not driver.in_step and torch_grad_enabled():
            # A forward that ran before watch() (watched from inside it, as ``gpumon run``
            # does): its micro-batch starts the step here, counted at the configured size.
            _safely(driver.micro_batch, engine, (), {})
        if not driver.in_step:
            return backward(*args, **kwargs)
        try:
            with phase("backward"):
                result = backward(*args, **kwargs)
        except BaseException as exc:
            driver.boundary(exc)
            raise
        sampler = extensions.get(MemoryBreakdownSampler)
        if sampler is not None:
            sampler.backward_done()
        return result

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        if not driver.in_step:
            return step(*args, **kwargs)
        at_boundary = _safe_bool(boundary)
        try:
            with phase("optimizer"):
                result = step(*args, **kwargs)
        except BaseException as exc:
            driver.boundary(exc)
            raise
        if at_boundary:
            driver.boundary()
        return result

    methods = [("forward", timed_forward), ("backward", timed_backward), ("step", timed_step)]
    train_batch = getattr(engine, "train_batch", None)
    if callable(train_batch):
        # A PipelineEngine runs its micro-batches' forwards, backwards and optimizer step
        # inside train_batch, through its own instructions, never through the methods above:
        # one step a call, its samples the batch's.
        def timed_train_batch(*args: Any, **kwargs: Any) -> Any:
            if driver.in_step or driver.user_steps:
                return train_batch(*args, **kwargs)
            _safely(driver.batch, _batch_samples(engine))
            try:
                result = train_batch(*args, **kwargs)
            except BaseException as exc:
                driver.boundary(exc)
                raise
            driver.boundary()
            return result

        methods.append(("train_batch", timed_train_batch))
    for name, method in methods:
        setattr(method, "__wrapped__", getattr(engine, name))  # noqa: B010 (a function's attribute)
        object.__setattr__(engine, name, method)
    object.__setattr__(engine, WATCHED_MARK, True)
    return driver


def _batch_samples(engine: Any) -> int | None:
    """A PipelineEngine's samples a train_batch on this rank: micro-batch x accumulation."""
    try:
        return int(engine.train_micro_batch_size_per_gpu()) \
            * int(engine.gradient_accumulation_steps())
    except Exception:
        return None


def _boundary_test(engine: Any) -> Callable[[], bool]:
    """Whether the next ``step()`` reaches the accumulation boundary (an optimizer update):
    every call does when the loop manages accumulation itself."""
    is_boundary = engine.is_gradient_accumulation_boundary
    managed = getattr(engine, "managed_gradient_accumulation", None)

    def test() -> bool:
        if callable(managed) and not managed():
            return True
        return bool(is_boundary())

    return test


def _training(engine: Any) -> bool:
    return torch_grad_enabled() and bool(getattr(engine, "training", True))


def torch_grad_enabled() -> bool:
    import torch

    return bool(torch.is_grad_enabled())


def _safe_bool(test: Callable[[], bool]) -> bool:
    try:
        return test()
    except Exception:
        log.debug("gpumon: could not tell DeepSpeed's accumulation boundary", exc_info=True)
        return True


def _safely(fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        log.debug("gpumon: could not count a DeepSpeed micro-batch", exc_info=True)


def rebind_backend() -> bool:
    """Point DeepSpeed's torch backend at the wrapped collectives (``comm.tap``): it bound
    ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` when ``init_distributed`` ran,
    perhaps before they were wrapped. False if its backend is not the torch one."""
    import sys

    comm = sys.modules.get("deepspeed.comm.comm")
    backend = getattr(comm, "cdb", None)
    if backend is None:
        return False
    rebound = False
    for attribute, getter in (("all_gather_function", "get_all_gather_function"),
                              ("reduce_scatter_function", "get_reduce_scatter_function")):
        get = getattr(backend, getter, None)
        if callable(get) and hasattr(backend, attribute):
            function = get()
            if function is not None:
                setattr(backend, attribute, function)
                rebound = True
    return rebound


GATHER_HANDLES = ("AllGatherHandle", "AllGatherCoalescedHandle", "MultipleAllGatherHandles")
"""ZeRO-3's handles on its asynchronous parameter all-gathers (in
``deepspeed.runtime.zero.partition_parameters``): the training thread waits in their ``wait``."""

_waiting_ledgers: list[CommLedger] = []


def time_gather_waits(ledger: CommLedger) -> bool:
    """Count the training thread's waits on ZeRO-3's parameter all-gathers as exposed
    communication in ``ledger`` (their launches and completions the wrapped collectives
    already see); the handles' ``wait`` is wrapped once per process. False if this DeepSpeed
    has none of them."""
    import sys

    module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if module is None:
        return False
    found = False
    for name in GATHER_HANDLES:
        cls = getattr(module, name, None)
        wait = getattr(cls, "wait", None)
        if cls is None or wait is None:
            continue
        found = True
        if not getattr(wait, WATCHED_MARK, False):
            cls.wait = _timed_wait(wait)
    if found and ledger not in _waiting_ledgers:
        _waiting_ledgers.append(ledger)
    return found


def _timed_wait(wait: Callable[..., Any]) -> Callable[..., Any]:
    import functools
    from time import perf_counter, thread_time

    @functools.wraps(wait)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not _waiting_ledgers:
            return wait(*args, **kwargs)
        c0, t0 = thread_time(), perf_counter()
        result = wait(*args, **kwargs)
        t1, c1 = perf_counter(), thread_time()
        for ledger in _waiting_ledgers:
            ledger.blocked(t0, t1, (c0, c1))
        return result

    setattr(timed, WATCHED_MARK, True)
    return timed
