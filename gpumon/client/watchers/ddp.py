"""DDP's gradient all-reduce, measured on the host by following its buckets, on a GPU by a
comm hook that wraps the real one.

DDP launches one all-reduce per gradient bucket from inside backward and, once the last
bucket is launched, waits for all of them before backward returns (its "finalize"). The
exposed communication is that wait, DDP's copies of the gradients into the buckets and out of
them, the work of a comm hook on the training thread (dividing, compressing), and, on CPU, the
time the backward they overlap lost its CPU to the all-reduce threads (``comm``'s contention).

**On the host** (a model on CPU, gloo) nothing is registered with DDP: its own C++ all-reduce
runs as without gpumon, scaling the gradients in the copy into the bucket, and its buckets are
followed from hooks on each gradient (``ddp_buckets``). A comm hook there would cost a pass over
every gradient a step (DDP copies them unscaled when any hook is registered, and the hook must
scale them again) and a Python call and callback per bucket: 2-4 % of a communication-heavy CPU
step.

**On a GPU** the hook registered is a thin wrapper: the scaling pass is a kernel of
microseconds there, and the hook is where the CUDA events that time each bucket are recorded.
By default it all-reduces the bucket as DDP itself does (the average over the group), on the
process group directly.

Either way, a hook the user registers later through ``register_comm_hook`` (or a built-in
one through ``_register_builtin_comm_hook``, replaced by its Python twin) runs with its own
state, its future returned as it is: gradients are identical, and it is measured through the
collectives it calls (``comm``'s wrapped ``torch.distributed`` functions), by what it actually
sends. A hook registered before ``watch()`` cannot be wrapped (DDP takes one hook, once): a
Python one is still measured through its collectives, with the wait taken as lasting from the
last launch to the last completion; a built-in C++ one calls no Python, so the step's
communication is reported as not measured. The CPU clock of the training thread is read at
the edges of the hooks and of the wait, where it is cheap, so contention is measured
without a reading inside backward's own work.
"""

from __future__ import annotations

import logging
from time import perf_counter, thread_time
from typing import Any

from gpumon.client.comm.ledger import CommLedger
from gpumon.client.comm.ops import Tail, record_event
from gpumon.client.comm.tap import tap_into
from gpumon.client.core.comm_inflight import IN_FLIGHT
from gpumon.client.watchers.ddp_buckets import Buckets

log = logging.getLogger("gpumon.client")

HOOKED = "hook"
FOLLOWED = "buckets"
INFERRED = "collectives"
NOT_MEASURED = "not measured"


class _Hooks:
    """The hook the wrapper calls, and its state; swapped when the user registers one."""

    def __init__(self, hook: Any, state: Any) -> None:
        self.hook = hook
        self.state = state
        self.user_registered = False


def watch_ddp(ledger: CommLedger, ddp: Any) -> str:
    """Measure ``ddp``'s communication into ``ledger``; returns how (``FOLLOWED`` on the
    host, ``HOOKED`` on a GPU, ``INFERRED`` or ``NOT_MEASURED``). Idempotent per module."""
    done = getattr(ddp, "_gpumon_comm", None)
    if done is not None:
        return str(done)
    mode, why = _watch(ledger, ddp)
    try:
        ddp._gpumon_comm = mode
    except AttributeError:
        pass
    if mode not in (HOOKED, FOLLOWED):
        log.warning("gpumon: DDP communication %s: %s", mode, why)
    return mode


def _watch(ledger: CommLedger, ddp: Any) -> tuple[str, str]:
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    except ImportError:
        return NOT_MEASURED, "this torch has no DDP comm hooks"
    if not tap_into(ledger):
        return NOT_MEASURED, "torch.distributed is not available"
    try:
        logged = ddp._get_ddp_logging_data()
        registered = logged.get("comm_hook")
        hooks_list = ddp._comm_hooks
        reducer_register = ddp.register_comm_hook
    except (AttributeError, RuntimeError) as exc:
        ledger.blind = True
        return NOT_MEASURED, f"this torch's DDP differs ({exc})"
    if registered:
        if hooks_list:  # a Python hook: its collectives are seen
            ledger.infer_tail = True
            return INFERRED, (f"its comm hook {registered} was registered before watch(), so the wait "
                              "at the end of backward is taken from the last launch to the last completion")
        ledger.blind = True
        return NOT_MEASURED, f"the built-in comm hook {registered} was registered before watch()"
    buckets = Buckets.follow(ledger, ddp, logged)
    if buckets is not None:

        def register_followed(state: object, hook: Any, name: str | None) -> None:
            reducer_register(state, hook)  # DDP's own checks and errors
            if name is not None:
                _set_hook_name(ddp, name)
            buckets.user_hook = True  # its collectives are seen where it calls them

        _take_over_registration(ddp, default_hooks, register_followed)
        return FOLLOWED, ""
    group = ddp.process_group
    if group is None or not hasattr(group, "allreduce"):
        import torch.distributed as dist

        group = dist.group.WORLD
    hooks = _Hooks(None, group)
    wrapper = _wrapper(ledger, hooks)
    try:
        reducer_register(None, wrapper)
    except (RuntimeError, ValueError, TypeError) as exc:
        ledger.blind = True
        return NOT_MEASURED, f"DDP refused the timing hook ({exc})"
    # The compiled-autograd path calls _comm_hooks per parameter: it must not see the
    # wrapper (which expects buckets), only a hook the user registered.
    hooks_list[:] = [entry for entry in hooks_list if entry[0] is not wrapper]

    def register_wrapped(state: object, hook: Any, name: str | None) -> None:
        if name is None:  # a Python hook: DDP's checks, as it would make them
            ddp._check_comm_hook(hook)
        if hooks.user_registered:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        hooks.hook, hooks.state, hooks.user_registered = hook, state, True
        _set_hook_name(ddp, name or hook.__qualname__)
        if name is None:
            ddp._comm_hooks.append((hook, state))

    _take_over_registration(ddp, default_hooks, register_wrapped)
    return HOOKED, ""


def _set_hook_name(ddp: Any, name: str) -> None:
    logger = getattr(ddp, "logger", None)
    if logger is not None:
        logger._set_comm_hook_name(name)


def _wrapper(ledger: CommLedger, hooks: _Hooks) -> Any:
    def gpumon_timed_comm_hook(state: object, bucket: Any) -> Any:
        c0, t0 = thread_time(), perf_counter()
        if hooks.hook is None:
            future = _all_reduce(ledger, hooks.state, bucket, t0)
        else:
            future = hooks.hook(hooks.state, bucket)
        t1, c1 = perf_counter(), thread_time()
        ledger.blocked(t0, t1, (c0, c1))
        is_last = getattr(bucket, "is_last", None)
        if is_last is not None and is_last():
            tail = ledger.wait_from(t1, mirrored=True)
            if tail is not None:
                _stamp_after_backward(tail)
        return future

    # DDP checks a hook's annotations against its own types; postponed ones are strings.
    gpumon_timed_comm_hook.__annotations__ = {}
    return gpumon_timed_comm_hook


def _all_reduce(ledger: CommLedger, group: Any, bucket: Any, t0: float) -> Any:
    """What DDP does with no hook: average the bucket over the group, bit for bit (scaled by
    the reciprocal of the group's size before the sum, as DDP scales while copying gradients
    into the bucket; ``default_hooks.allreduce_hook`` divides, which differs in the last bit
    for a group of 3). Called on the process group itself (``torch.distributed``'s checks
    around it would cost every bucket again) and timed by the one callback it needs anyway.

    A hook costs one pass over the gradients DDP saves without one: it scales them in that
    copy only when no hook is registered (with ``gradient_as_bucket_view=True`` there is no
    copy, and no difference)."""
    tensor = bucket.buffer()
    tensor.mul_(1.0 / group.size())
    on_host = tensor.device.type == "cpu"
    clock = None if on_host or not ledger.in_step else ledger.device_clock()
    start = None if clock is None else record_event(clock)
    nbytes = tensor.numel() * tensor.element_size()
    seq = IN_FLIGHT.begin("all_reduce", nbytes)
    try:
        work = group.allreduce([tensor])
    except BaseException:
        IN_FLIGHT.end(seq)
        raise
    op = ledger.launched("all_reduce", nbytes, t0, perf_counter(), on_host, device_start=start)

    def averaged(future: Any) -> Any:
        IN_FLIGHT.completed(seq, not on_host)
        if op is not None:
            if clock is None:
                op.t_done = perf_counter()
            else:
                op.device_done(clock)
        return future.value()[0]

    return work.get_future().then(averaged)


def _stamp_after_backward(tail: Tail) -> None:
    """Stamp ``tail``'s end when backward resumes after DDP's finalize.

    DDP queues its finalize (the wait for every bucket, then copying them back into the
    gradients) as an autograd-engine callback when the last bucket is ready, after this
    hook returns; a callback queued now runs before it, and one queued by that callback
    runs after it (the engine runs callbacks added while running callbacks, in order).
    Both run on the stream backward was called on, once its last kernel is queued: on a
    GPU, the first records the wait's start event and the second its end, after DDP made
    that stream wait for the buckets.
    Outside backward (DDP's join hooks) or on an engine without this, the completion of
    the step's collectives ends the wait instead.
    """
    try:
        import torch

        engine = torch.autograd.Variable._execution_engine

        def after_finalize_is_queued() -> None:
            tail.waiting()
            engine.queue_callback(tail.resumed)

        engine.queue_callback(after_finalize_is_queued)
    except (AttributeError, RuntimeError):
        return


def _take_over_registration(ddp: Any, default_hooks: Any, register: Any) -> None:
    """Route ``register_comm_hook`` and ``_register_builtin_comm_hook`` on this module into
    ``register(state, hook, name)`` (``name`` None for a Python hook, the built-in's name
    for its Python twin), with DDP's own checks and errors."""

    def register_comm_hook(state: object, hook: Any) -> None:
        register(state, hook, None)

    def _register_builtin_comm_hook(comm_hook_type: Any) -> None:
        import torch.distributed as dist

        kinds = dist.BuiltinCommHookType
        builtin = {kinds.ALLREDUCE: default_hooks.allreduce_hook,
                   kinds.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        hook = builtin.get(comm_hook_type)
        if hook is None:
            raise ValueError(f"unknown built-in comm hook {comm_hook_type!r}")
        register(ddp.process_group, hook, str(comm_hook_type))

    ddp.register_comm_hook = register_comm_hook
    ddp._register_builtin_comm_hook = _register_builtin_comm_hook
