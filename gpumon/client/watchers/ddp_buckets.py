"""DDP's gradient buckets followed on the host, without a comm hook (``ddp`` decides when).

Nothing is registered with DDP: its own scaled copy into the buckets and its C++ all-reduce run
as unwatched. Each gradient gets a hook that runs once it is accumulated, before DDP's, and one
on its accumulator after DDP's: the span between them is DDP's copy into the bucket and, for the
gradient that completes a bucket, the bucket's launch. Which gradients make up which bucket DDP
tells through a copy of its buckets, read at ``watch()`` and once more after it re-sizes them
after its first step (beyond ``Buckets.LAYOUT_READ_MAX_BYTES``, the sizes from its logging data).
Two autograd-engine callbacks stamp DDP's end-of-backward wait: one queued at the first gradient,
which runs before DDP's finalize, and one it queues, which runs after. A bucket's completion is
not seen: each is taken to complete at the end of that wait (docs/architecture.md §5.1).
"""

from __future__ import annotations

import logging
import weakref
from time import perf_counter, thread_time
from typing import Any

from gpumon.client.comm.ledger import CommLedger
from gpumon.client.comm.ops import Op, Tail
from gpumon.client.core.comm_inflight import IN_FLIGHT

log = logging.getLogger("gpumon.client")


def reducer_params(ddp: Any) -> list[Any]:
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


class Buckets:
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
    def follow(cls, ledger: CommLedger, ddp: Any, logged: dict[str, Any]) -> Buckets | None:
        """Follow ``ddp``'s buckets if its parameters are all on the host and this torch
        has what it takes; None otherwise (the comm hook is used instead)."""
        try:
            import torch
            from torch.autograd.graph import get_gradient_edge

            engine = torch.autograd.Variable._execution_engine
            params = reducer_params(ddp)
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
