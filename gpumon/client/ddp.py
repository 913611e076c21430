"""DDP's gradient all-reduce, timed through a comm hook that wraps the real one.

DDP launches one all-reduce per gradient bucket from inside backward and, once the last
bucket is launched, waits for all of them before backward returns (its "finalize"). The
exposed communication is that wait, the hook's own work on the training thread (dividing,
compressing), DDP's copies of the gradients into the buckets (timed on CPU by two autograd
hooks around DDP's own; on a GPU taken to cost what the copy back costs, ``comm.Tail``) and
out of them, and, on CPU, the time the backward they overlap lost its CPU to the all-reduce threads
(``comm``'s contention). On a GPU the same wait is read from CUDA events instead (``comm``:
on a GPU). The CPU clock of the training thread is read at the edges of the
hook and of the wait, where it is cheap (~1 µs), so contention is measured without a reading
inside backward's own work.

The hook registered is a thin wrapper. By default it all-reduces the bucket as DDP itself
does (the average over the group), on the process group directly. A hook the user registers
later through ``register_comm_hook`` (or a built-in one through
``_register_builtin_comm_hook``, replaced by its Python twin) is called instead, with its own
state, and its future returned as it is: gradients are identical, and it is measured
through the collectives it calls (``comm``'s wrapped ``torch.distributed`` functions), by
what it actually sends. A hook registered before ``watch()`` cannot be wrapped (DDP takes
one hook, once): a Python one is still measured through its collectives, with the wait taken
as lasting from the last launch to the last completion; a built-in C++ one calls no Python,
so the step's communication is reported as not measured.
"""

from __future__ import annotations

import logging
import weakref
from time import perf_counter, thread_time
from typing import Any

from gpumon.client.comm import CommLedger, Tail
from gpumon.client.comm_device import record_event
from gpumon.client.comm_inflight import IN_FLIGHT
from gpumon.client.comm_tap import tap_into

log = logging.getLogger("gpumon.client")

HOOKED = "hook"
INFERRED = "collectives"
NOT_MEASURED = "not measured"


class _Hooks:
    """The hook the wrapper calls, and its state; swapped when the user registers one."""

    def __init__(self, hook: Any, state: Any) -> None:
        self.hook = hook
        self.state = state
        self.user_registered = False
        self.copies_timed = False  # DDP's copies into the buckets are timed (on CPU)


def watch_ddp(ledger: CommLedger, ddp: Any) -> str:
    """Measure ``ddp``'s communication into ``ledger``; returns how (``HOOKED``,
    ``INFERRED`` or ``NOT_MEASURED``). Idempotent per module."""
    done = getattr(ddp, "_gpumon_comm", None)
    if done is not None:
        return str(done)
    mode, why = _watch(ledger, ddp)
    try:
        ddp._gpumon_comm = mode
    except AttributeError:
        pass
    if mode != HOOKED:
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
        registered = ddp._get_ddp_logging_data().get("comm_hook")
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
    _take_over_registration(ddp, hooks, default_hooks)
    hooks.copies_timed = _time_copies_into_buckets(ledger, ddp)
    return HOOKED, ""


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
            tail = ledger.wait_from(t1, mirrored=not hooks.copies_timed)
            if tail is not None:
                _stamp_after_backward(tail)
        return future

    # DDP checks a hook's annotations against its own types; postponed ones are strings.
    gpumon_timed_comm_hook.__annotations__ = {}
    return gpumon_timed_comm_hook


def _time_copies_into_buckets(ledger: CommLedger, ddp: Any) -> bool:
    """On CPU, time DDP copying each gradient into its bucket (its own autograd hook on the
    gradient's accumulator, inside backward) as work the training thread does for
    communication; True if every gradient's copy is timed.

    Each parameter gets a hook that runs once its gradient is accumulated, before DDP's
    (which makes the copy, and launches the bucket's all-reduce when it completes one), and
    one on the accumulator that runs after DDP's: the span between them is the copy, ~0.03 ms
    where DDP makes none (``no_sync``, ``gradient_as_bucket_view=True``). Two Python calls of
    ~2 µs a parameter a step. On a GPU the copy is a kernel the events around DDP's wait
    account for (``comm.Tail``), so nothing is registered there."""
    try:
        from torch.autograd.graph import get_gradient_edge
    except ImportError:
        return False
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if not params or any(p.device.type != "cpu" for p in params):
        return False
    try:
        nodes = [get_gradient_edge(p).node for p in params]
        if not all(hasattr(p, "register_post_accumulate_grad_hook") for p in params):
            return False
    except (AttributeError, RuntimeError):
        return False
    start = [0.0, 0.0]  # wall and CPU clock when the gradient being copied was accumulated
    module = weakref.ref(ddp)  # the hooks live on its parameters: no cycle back to it

    def accumulated(_param: Any) -> None:
        start[0], start[1] = perf_counter(), thread_time()

    def copied(_grad_inputs: Any, _grad_outputs: Any) -> None:
        syncing = getattr(module(), "require_backward_grad_sync", False)  # False under no_sync()
        if ledger.in_step and start[0] and syncing:
            c1, t1 = thread_time(), perf_counter()
            ledger.blocked(start[0], t1, (start[1], c1))
            start[0] = 0.0

    for param, node in zip(params, nodes, strict=True):
        param.register_post_accumulate_grad_hook(accumulated)
        node.register_hook(copied)
    return True


def _all_reduce(ledger: CommLedger, group: Any, bucket: Any, t0: float) -> Any:
    """What DDP does with no hook: average the bucket over the group, bit for bit (scaled by
    the reciprocal of the group's size before the sum, as DDP scales while copying gradients
    into the bucket; ``default_hooks.allreduce_hook`` divides, which differs in the last bit
    for a group of 3). Called on the process group itself (``torch.distributed``'s checks
    around it cost ~25 µs a bucket) and timed by the one callback it needs anyway.

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


def _take_over_registration(ddp: Any, hooks: _Hooks, default_hooks: Any) -> None:
    """Route ``register_comm_hook`` and ``_register_builtin_comm_hook`` on this module into
    the wrapper, with DDP's own checks and errors."""

    def register_comm_hook(state: object, hook: Any) -> None:
        ddp._check_comm_hook(hook)
        _register(state, hook, hook.__qualname__)
        ddp._comm_hooks.append((hook, state))

    def _register_builtin_comm_hook(comm_hook_type: Any) -> None:
        import torch.distributed as dist

        kinds = dist.BuiltinCommHookType
        builtin = {kinds.ALLREDUCE: default_hooks.allreduce_hook,
                   kinds.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        hook = builtin.get(comm_hook_type)
        if hook is None:
            raise ValueError(f"unknown built-in comm hook {comm_hook_type!r}")
        _register(ddp.process_group, hook, str(comm_hook_type))

    def _register(state: object, hook: Any, name: str) -> None:
        if hooks.user_registered:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        hooks.hook, hooks.state, hooks.user_registered = hook, state, True
        logger = getattr(ddp, "logger", None)
        if logger is not None:
            logger._set_comm_hook_name(name)

    ddp.register_comm_hook = register_comm_hook
    ddp._register_builtin_comm_hook = _register_builtin_comm_hook
