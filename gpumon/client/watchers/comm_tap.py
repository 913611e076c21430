"""``torch.distributed``'s collective functions, wrapped once per process to report each call
to the watching ledgers (``comm.CommLedger``): its launch, payload and completion (on return
when blocking, by a callback on its ``Work``'s future when ``async_op=True``; on a GPU, by
CUDA events). The calls DDP comm hooks, FSDP and user code make all pass through them.

The wrapped functions cost a check of one list when no monitor is watching.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from time import perf_counter, thread_time
from typing import Any

from gpumon.client.core.comm_inflight import IN_FLIGHT
from gpumon.client.watchers.comm import CommLedger
from gpumon.client.watchers.comm_ops import record_event

log = logging.getLogger("gpumon.client")

COLLECTIVES: dict[str, tuple[str, int, str]] = {
    # function name: (wire name, position of the payload argument, its keyword); -1: none
    "all_reduce": ("all_reduce", 0, "tensor"),
    "all_reduce_coalesced": ("all_reduce", 0, "tensors"),
    "broadcast": ("broadcast", 0, "tensor"),
    "reduce": ("reduce", 0, "tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "_all_gather_base": ("all_gather", 0, "output_tensor"),
    "reduce_scatter": ("reduce_scatter", 1, "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "_reduce_scatter_base": ("reduce_scatter", 1, "input"),
    "all_to_all": ("all_to_all", 1, "input_tensor_list"),
    "all_to_all_single": ("all_to_all", 1, "input"),
    "gather": ("gather", 0, "tensor"),
    "scatter": ("scatter", 0, "tensor"),
    "barrier": ("barrier", -1, ""),
}
"""The ``torch.distributed`` functions measured, and how each names its payload."""


WRAPPED_MARK = "__gpumon_wrapped__"
"""The attribute that marks a function as one of these wrappers (so a second copy of this
module, or a reload, never wraps a wrapper)."""

_ledgers: list[CommLedger] = []
"""The ledgers the wrapped functions report to (one per watching monitor, usually one)."""
_installed = False
_install_lock = threading.Lock()
_inside = threading.local()
"""``collective`` is True on a thread inside a wrapped function: one that calls another
(torch's ``all_gather_into_tensor`` calls ``all_gather_single``) is one collective, counted once."""


def tap_into(ledger: CommLedger) -> bool:
    """Report this process's ``torch.distributed`` collectives to ``ledger``; False if the
    functions could not be wrapped (no ``torch.distributed``)."""
    if not install_tap():
        return False
    if ledger not in _ledgers:
        _ledgers.append(ledger)
    return True


def untap(ledger: CommLedger) -> None:
    """Stop reporting to ``ledger`` (the wrappers stay, passing straight through)."""
    if ledger in _ledgers:
        _ledgers.remove(ledger)


def install_tap() -> bool:
    """Wrap the collective functions of ``torch.distributed`` once per process."""
    global _installed
    with _install_lock:
        if _installed:
            return True
        try:
            import torch.distributed as dist
            from torch.distributed import distributed_c10d
        except ImportError:
            return False
        if not dist.is_available():
            return False
        for fn_name, (wire_name, position, keyword) in COLLECTIVES.items():
            original = getattr(distributed_c10d, fn_name, None)
            if original is None or getattr(original, WRAPPED_MARK, False):
                continue  # not in this torch version: not measured
            wrapped = _wrap(original, wire_name, position, keyword)
            setattr(distributed_c10d, fn_name, wrapped)
            if getattr(dist, fn_name, None) is original:
                setattr(dist, fn_name, wrapped)
        _installed = True
        return True


def _wrap(original: Callable[..., Any], name: str, position: int, keyword: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if not _ledgers or getattr(_inside, "collective", False):
            return original(*args, **kwargs)
        payload = _payload(args, kwargs, position, keyword)
        seq = _opened(name, payload)
        c0, t0 = thread_time(), perf_counter()
        _inside.collective = True
        try:
            result = original(*args, **kwargs)
        except BaseException:
            IN_FLIGHT.end(seq)
            raise
        finally:
            _inside.collective = False
        t1, c1 = perf_counter(), thread_time()
        try:
            _follow(seq, payload, result)
            _record(name, payload, t0, t1, result, (c0, c1))
        except Exception:  # measuring must never break the collective
            log.debug("gpumon: could not record a %s", name, exc_info=True)
        return result

    setattr(collective, WRAPPED_MARK, True)
    return collective


def _opened(name: str, payload: Any) -> int:
    """Number the collective about to be launched (``IN_FLIGHT``), before it may block."""
    try:
        return IN_FLIGHT.begin(name, _nbytes(_tensors(payload)))
    except Exception:
        return IN_FLIGHT.begin(name, 0)


def _follow(seq: int, payload: Any, result: Any) -> None:
    """Mark ``seq`` complete when it is: now when the call blocked, else by its future (on a
    GPU, once an event recorded in the future's callback has passed)."""
    get_future = getattr(result, "get_future", None)
    if get_future is None:
        IN_FLIGHT.end(seq)
        return
    on_device = not all(t.device.type == "cpu" for t in _tensors(payload))
    try:
        future = get_future()
        future.add_done_callback(lambda _future: IN_FLIGHT.completed(seq, on_device))
    except RuntimeError:  # no future for this op: its completion cannot be followed
        IN_FLIGHT.end(seq)


def _tensors(payload: Any) -> list[Any]:
    return list(payload) if isinstance(payload, (list, tuple)) else [] if payload is None else [payload]


def _nbytes(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _payload(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, keyword: str) -> Any:
    if position < 0:
        return None
    if keyword in kwargs:
        return kwargs[keyword]
    return args[position] if len(args) > position else None


def _record(name: str, payload: Any, t0: float, t1: float, result: Any,
            cpu: tuple[float, float] | None = None) -> None:
    tensors = _tensors(payload)
    nbytes = _nbytes(tensors)
    host_timed = all(t.device.type == "cpu" for t in tensors)
    for ledger in _ledgers:
        clock = ledger.device_clock() if not host_timed and ledger.in_step else None
        get_future = getattr(result, "get_future", None)
        if clock is not None and get_future is not None:
            _record_on_device(ledger, clock, name, nbytes, t0, t1, get_future)
            continue
        op = ledger.launched(name, nbytes, t0, t1, host_timed, cpu)
        if op is None:
            continue
        if get_future is None:  # returned after completing (or not part of the group)
            op.t_done = t1
            continue
        try:
            get_future().add_done_callback(op.done)
        except RuntimeError:  # this backend gives no future for this op: completion unknown
            op.t_done = t1


def _record_on_device(ledger: CommLedger, clock: Any, name: str, nbytes: int, t0: float, t1: float,
                      get_future: Callable[[], Any]) -> None:
    """An asynchronous collective on a GPU: an event now marks its launch (its stream waits
    for the work queued before it, and nothing after it is queued yet), one in its future's
    callback its completion. A blocking call gives no future: it is not timed."""
    op = ledger.launched(name, nbytes, t0, t1, False, device_start=record_event(clock))
    if op is None:
        return
    try:
        get_future().add_done_callback(lambda _future: op.device_done(clock))
    except RuntimeError:  # no future for this op after all: its completion is unknown
        op.events = None
