"""DDP's gradient all-reduce, measured on the host by following its buckets, on a GPU by a
comm hook that wraps the real one.

DDP launches one all-reduce per gradient bucket from inside backward and, once the last
bucket is launched, waits for all of them before backward returns (its "finalize"). The
exposed communication is that wait, DDP's copies of the gradients into the buckets and out of
them, the work of a comm hook on the training thread (dividing, compressing), and, on CPU, the
time the backward they overlap lost its CPU to the all-reduce threads (``comm``'s contention).

**On the host** (a model on CPU, gloo) nothing is registered with DDP: its own C++ all-reduce
runs as without gpumon, scaling the gradients in the copy into the bucket. A comm hook there
would cost a pass over every gradient a step (DDP copies them unscaled when any hook is
registered, and the hook must scale them again) and a Python call and callback per bucket:
2-4 % of a communication-heavy CPU step. Instead (``_Buckets``) each gradient gets a hook that
runs once it is accumulated, before DDP's, and one on its accumulator after DDP's: the span
between them is DDP's copy into the bucket and, for the gradient that completes a bucket, the
bucket's launch. Which gradients make up which bucket, DDP says itself once it has sized them
after the first step (its logging data); until then a bucket is taken as launched once the
gradients copied add up to it. Two autograd-engine callbacks stamp the wait: one queued before
DDP's finalize, which runs once backward's own work is done, and one queued after it. A
bucket's completion is not seen without a hook: each is taken to complete at the end of that
wait, so ``busy`` is exact at its edges and the seconds per all-reduce are an upper bound.

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
the edges of the hooks and of the wait, where it is cheap (~1 µs), so contention is measured
without a reading inside backward's own work.
"""

from __future__ import annotations

import logging
import weakref
from time import perf_counter, thread_time
from typing import Any

from gpumon.client.comm import CommLedger, Op, Tail
from gpumon.client.comm_device import record_event
from gpumon.client.comm_inflight import IN_FLIGHT
from gpumon.client.comm_tap import tap_into

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
    buckets = _Buckets.follow(ledger, ddp, logged)
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


def _reducer_params(ddp: Any) -> list[Any]:
    """The parameters DDP's reducer holds, in its order (its variable indices): those that
    require a gradient and are not ignored, module by module, each once."""
    ignored = getattr(ddp, "parameters_to_ignore", ()) or ()
    seen: set[int] = set()
    params = []
    for module_name, module in ddp.module.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and f"{module_name}.{name}" not in ignored and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


class _Buckets:
    """DDP's buckets followed on the host without a comm hook (see the module docstring).

    Everything runs on the training thread, in backward: ``accumulated`` when a gradient is
    ready (before DDP copies it), ``copied`` after DDP's hook on it, then the two engine
    callbacks around DDP's finalize."""

    LAYOUT_READ_MAX_BYTES = 1 << 30
    """DDP tells its buckets' members only through a copy of them (zeros); read that way, once
    at the start and once after DDP re-sizes them after its first step, up to this size.
    Beyond, the sizes are read from its logging data and a bucket is taken as launched once
    the gradients copied add up to it."""

    def __init__(self, ledger: CommLedger, ddp: Any, params: list[Any], engine: Any) -> None:
        self.ledger = ledger
        self.module = weakref.ref(ddp)  # the hooks live on its parameters: no cycle back to it
        self.engine = engine
        self.index = {id(p): i for i, p in enumerate(params)}
        self.nbytes = [p.numel() * p.element_size() for p in params]
        self.sizes: list[int] = [sum(self.nbytes)]  # bytes per bucket, in launch order
        self.bucket_of: list[int] | None = None  # variable index -> bucket, where known
        self.rebuilt = False  # DDP re-sized its buckets (after its first step), and this knows
        self.user_hook = False
        # This backward's:
        self.armed_in: object = None  # the ledger's step it was armed in
        self.start = (0.0, 0.0)  # wall and CPU clock when the gradient being copied was accumulated
        self.left: list[int] = []  # gradients each bucket still waits for
        self.copied_bytes = 0
        self.next = 0  # the next bucket to launch
        self.ops: list[Op] = []
        self.seqs: list[int] = []
        self.tail: Tail | None = None

    @classmethod
    def follow(cls, ledger: CommLedger, ddp: Any, logged: dict[str, Any]) -> _Buckets | None:
        """Follow ``ddp``'s buckets if its parameters are all on the host and this torch
        has what it takes; None otherwise (the comm hook is used instead)."""
        try:
            import torch
            from torch.autograd.graph import get_gradient_edge

            engine = torch.autograd.Variable._execution_engine
            params = _reducer_params(ddp)
            if not params or any(p.device.type != "cpu" for p in params):
                return None
            if not all(hasattr(p, "register_post_accumulate_grad_hook") for p in params):
                return None
            nodes = [get_gradient_edge(p).node for p in params]
        except (ImportError, AttributeError, RuntimeError):
            return None
        buckets = cls(ledger, ddp, params, engine)
        buckets.read_layout(ddp, logged)
        for index, (param, node) in enumerate(zip(params, nodes, strict=True)):
            param.register_post_accumulate_grad_hook(buckets.accumulated)
            node.register_hook(buckets.copied_hook(index))
        return buckets

    def read_layout(self, ddp: Any, logged: dict[str, Any] | None = None) -> bool:
        """Learn which gradients make up which bucket; True if it is known now."""
        if sum(self.nbytes) <= self.LAYOUT_READ_MAX_BYTES:
            try:
                members = [[self.index[id(p)] for p in bucket.parameters()]
                           for bucket in ddp.reducer._get_zeros_like_grad_buckets()]
            except (AttributeError, RuntimeError, KeyError):
                members = None
            if members:
                self._set_members(members)
                return True
        try:
            logged = logged if logged is not None else ddp._get_ddp_logging_data()
        except (AttributeError, RuntimeError):
            return False
        rebuilt = logged.get("rebuilt_per_bucket_param_indices")
        if isinstance(rebuilt, str) and rebuilt.strip():
            try:
                self._set_members([[int(i) for i in part.split()] for part in rebuilt.split(",")])
                return True
            except (ValueError, IndexError):
                return False
        sizes = logged.get("bucket_sizes")
        if not self.rebuilt and isinstance(sizes, str) and sizes.strip():
            try:
                parsed = [int(size) for size in sizes.split(",")]
            except ValueError:
                return False
            if sum(parsed) == sum(self.nbytes):
                self.sizes, self.bucket_of = parsed, None
        return False

    def _set_members(self, members: list[list[int]]) -> None:
        bucket_of = [0] * len(self.nbytes)
        for bucket, indices in enumerate(members):
            for i in indices:
                bucket_of[i] = bucket
        self.bucket_of = bucket_of
        self.sizes = [sum(self.nbytes[i] for i in indices) for indices in members]

    def accumulated(self, _param: Any) -> None:
        try:
            ledger = self.ledger
            if ledger.in_step:
                self.start = (perf_counter(), thread_time())
                if self.armed_in is not ledger.step_token:
                    self._arm(ledger)
        except Exception:  # never into backward
            log.debug("gpumon: DDP bucket not followed", exc_info=True)

    def _arm(self, ledger: CommLedger) -> None:
        ddp = self.module()
        if ddp is None or not getattr(ddp, "require_backward_grad_sync", False):  # no_sync()
            return
        # The first gradient of a synced backward: DDP queues its finalize once its last
        # bucket is launched, after this; a callback queued now runs before it.
        if not self.rebuilt and getattr(ddp, "_has_rebuilt_buckets", False):
            self.rebuilt = self.read_layout(ddp)  # (else read again next step, until DDP logs it)
        self.armed_in = ledger.step_token
        self.left = [0] * len(self.sizes)
        if self.bucket_of is not None:
            for bucket in self.bucket_of:
                self.left[bucket] += 1
        self.copied_bytes = 0
        self.next = 0
        self.ops, self.seqs, self.tail = [], [], None
        try:
            self.engine.queue_callback(self._before_finalize)
        except RuntimeError:  # not inside the engine's backward
            self.armed_in = None

    def copied_hook(self, index: int) -> Any:
        def copied(_grad_inputs: Any, _grad_outputs: Any) -> None:
            try:
                t0, c0 = self.start
                if t0 and self.armed_in is not None and self.armed_in is self.ledger.step_token:
                    c1, t1 = thread_time(), perf_counter()
                    self.ledger.blocked(t0, t1, (c0, c1))
                    self.start = (0.0, 0.0)
                    if not self.user_hook:  # (a user's hook launches what it does, seen there)
                        self._ready(index, t0, t1)
            except Exception:  # never into backward
                log.debug("gpumon: DDP bucket not followed", exc_info=True)

        return copied

    def _ready(self, index: int, t0: float, t1: float) -> None:
        """Gradient ``index`` is in its bucket: launch what DDP launched with it."""
        left = self.left
        if self.bucket_of is not None:
            left[self.bucket_of[index]] -= 1
            while self.next < len(left) and left[self.next] <= 0:
                self._launch(t0, t1)
        else:  # in launch order
            self.copied_bytes += self.nbytes[index]
            while self.next < len(left) and self.copied_bytes >= sum(self.sizes[: self.next + 1]):
                self._launch(t0, t1)

    def _launch(self, t0: float, t1: float) -> None:
        nbytes = self.sizes[self.next]
        self.next += 1
        self.seqs.append(IN_FLIGHT.begin("all_reduce", nbytes))
        op = self.ledger.launched("all_reduce", nbytes, t0, t1, True)
        if op is not None:
            self.ops.append(op)

    def _before_finalize(self) -> None:
        """Backward's own work is done; DDP's finalize (the wait for every bucket, then the
        copies back into the gradients) runs next."""
        try:
            self._waiting()
        except Exception:  # never into backward
            log.debug("gpumon: DDP's wait not timed", exc_info=True)

    def _waiting(self) -> None:
        now = perf_counter()
        if not self.user_hook:
            while self.next < len(self.sizes):  # what was not seen launching: launched by now
                self._launch(now, now)
        self.tail = self.ledger.wait_from(now)
        self.engine.queue_callback(self._after_finalize)

    def _after_finalize(self) -> None:
        try:
            self._resumed()
        except Exception:  # never into backward
            log.debug("gpumon: DDP's wait not timed", exc_info=True)

    def _resumed(self) -> None:
        tail = self.tail
        if tail is not None:
            tail.resumed()
        end = perf_counter() if tail is None or tail.end is None else tail.end
        for op in self.ops:
            op.t_done = end
        for seq in self.seqs:
            IN_FLIGHT.end(seq)
        self.ops, self.seqs, self.tail = [], [], None
        self.armed_in = None


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
