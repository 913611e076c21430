"""The functional collectives (``tapped.TAPPED``'s ``torch.distributed._functional_collectives``
rows) and their ``wait_tensor``, wrapped once per process beside the ``torch.distributed``
functions (``tap``).

DTensor (tensor and sequence parallelism, FSDP2's DTensor parameters, async TP) issues its
collectives through these functions: each launches ``torch.ops._c10d_functional``'s op and
returns at once, eagerly as an ``AsyncCollectiveTensor`` that calls ``wait_tensor`` when it is
first used. So a call is reported as its launch, and the wait on its tensor as its completion
and as the time it held the training thread up. A collective whose tensor is never waited on
through ``wait_tensor`` counts from its launch to its return.

On a GPU an event on the current stream marks the launch, and one after the wait the
completion; the wait itself is timed by events around it (``ledger.wait_from``).

Under ``torch.compile`` the wrappers pass straight through, so that tracing sees the functions
it knows and adds no graph break: the collectives a compiled graph runs are not measured.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from time import perf_counter, thread_time
from typing import Any

from gpumon.client.comm.ledger import CommLedger
from gpumon.client.comm.ops import Op, record_event
from gpumon.client.comm.tapped import FUNCTIONAL, rows
from gpumon.client.core.comm_inflight import IN_FLIGHT

log = logging.getLogger("gpumon.client")

MAX_UNWAITED = 4096
"""Launched collectives remembered until their tensor is waited on; beyond, the oldest are
forgotten (they keep the completion their launch gave them)."""

WRAPPED_MARK = "__gpumon_wrapped__"

_pending: OrderedDict[int, tuple[weakref.ref[Any], int, list[Op]]] = OrderedDict()
"""id(tensor) -> (the tensor, its IN_FLIGHT number, its ops in the ledgers) of each launched
collective not waited on yet."""
_is_compiling: Callable[[], bool] = lambda: False  # noqa: E731 (torch's, once installed)


def install_functional(ledgers: list[CommLedger], inside: threading.local) -> bool:
    """Wrap the functional collectives of this torch, reporting to ``ledgers``; ``inside`` is
    the tap's marker of a thread inside a wrapped call (one call is one collective). False
    where this torch has none."""
    global _is_compiling
    try:
        import torch
        from torch.distributed import _functional_collectives as funcol
    except ImportError:
        return False
    _is_compiling = torch.compiler.is_compiling
    for row in rows(FUNCTIONAL):
        original = getattr(funcol, row.function, None)
        if original is None or getattr(original, WRAPPED_MARK, False):
            continue
        setattr(funcol, row.function,
                _wrap(original, ledgers, inside, row.op, row.position, row.keyword, row.output))
    wait = getattr(funcol, "wait_tensor", None)
    if wait is not None and not getattr(wait, WRAPPED_MARK, False):
        funcol.wait_tensor = _wrap_wait(wait, ledgers, inside)
    return True


def _wrap(original: Callable[..., Any], ledgers: list[CommLedger], inside: threading.local,
          name: str, position: int, keyword: str, output: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if _is_compiling() or not ledgers or getattr(inside, "collective", False):
            return original(*args, **kwargs)
        payload = kwargs[keyword] if keyword in kwargs else \
            args[position] if len(args) > position else None
        tensors = _tensors(payload)
        seq = IN_FLIGHT.begin(name, _nbytes(tensors))
        c0, t0 = thread_time(), perf_counter()
        inside.collective = True
        try:
            result = original(*args, **kwargs)
        except BaseException:
            IN_FLIGHT.end(seq)
            raise
        finally:
            inside.collective = False
        t1, c1 = perf_counter(), thread_time()
        try:
            counted = _tensors(result) if output else tensors
            ops = [op for ledger in ledgers
                   if (op := _launched(ledger, name, counted, t0, t1, (c0, c1))) is not None]
            _remember(result, seq, ops)
        except Exception:  # measuring must never break the collective
            IN_FLIGHT.end(seq)
            log.debug("gpumon: could not record a functional %s", name, exc_info=True)
        return result

    setattr(collective, WRAPPED_MARK, True)
    return collective


def _launched(ledger: CommLedger, name: str, tensors: list[Any], t0: float, t1: float,
              cpu: tuple[float, float]) -> Op | None:
    """Report a launch to ``ledger``: done at its return until its wait says otherwise."""
    host_timed = all(t.device.type == "cpu" for t in tensors)
    clock = None if host_timed or not ledger.in_step else ledger.device_clock()
    if clock is None:
        op = ledger.launched(name, _nbytes(tensors), t0, t1, host_timed, cpu)
        if op is not None:
            op.t_done = t1
        return op
    op = ledger.launched(name, _nbytes(tensors), t0, t1, False, cpu,
                         device_start=record_event(clock))
    if op is not None and op.events is not None:
        op.events[1] = record_event(clock)  # its completion until its wait is seen
    return op


def _wrap_wait(original: Callable[..., Any], ledgers: list[CommLedger],
               inside: threading.local) -> Callable[..., Any]:
    @functools.wraps(original)
    def wait_tensor(tensor: Any) -> Any:
        if _is_compiling() or not _pending:
            return original(tensor)
        entry = _pending.pop(id(tensor), None)  # (a single dict operation: no lock needed)
        if entry is None or entry[0]() is not tensor:
            return original(tensor)
        _, seq, ops = entry
        nested = getattr(inside, "collective", False)  # its launch's call already counts it
        tails = []
        for ledger in ledgers:
            clock = ledger.device_clock() if ledger.in_step and any(
                op.events is not None for op in ops) else None
            if clock is not None and not nested:
                tail = ledger.wait_from(perf_counter())
                if tail is not None:
                    tail.waiting()
                    tails.append(tail)
        c0, t0 = thread_time(), perf_counter()
        try:
            return original(tensor)
        finally:
            t1, c1 = perf_counter(), thread_time()
            IN_FLIGHT.end(seq)
            try:
                _waited(ops, ledgers, tails, nested, t0, t1, (c0, c1))
            except Exception:
                log.debug("gpumon: could not record a functional wait", exc_info=True)

    setattr(wait_tensor, WRAPPED_MARK, True)
    return wait_tensor


def _waited(ops: list[Op], ledgers: list[CommLedger], tails: list[Any], nested: bool,
            t0: float, t1: float, cpu: tuple[float, float]) -> None:
    for tail in tails:
        tail.resumed()
    for op in ops:
        op.t_done = max(op.t_done or t1, t1)
        clock = tails[0].clock if tails else None
        if op.events is not None and clock is not None:
            stale = op.events[1]
            op.events[1] = record_event(clock)
            if stale is not None:
                try:
                    clock.release(stale)
                except Exception:
                    pass
    if not nested and not tails:
        for ledger in ledgers:
            ledger.blocked(t0, t1, cpu)


def _remember(result: Any, seq: int, ops: list[Op]) -> None:
    """Keep a launch until its tensor is waited on (the raw tensor an eager call wraps)."""
    for tensor in _tensors(result):
        raw = getattr(tensor, "elem", tensor)
        _pending[id(raw)] = (weakref.ref(raw), seq, ops)
        if len(_pending) > MAX_UNWAITED:
            _, (_, old, _) = _pending.popitem(last=False)
            IN_FLIGHT.end(old)


def _tensors(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _nbytes(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
