"""``torch.distributed``'s collectives and point-to-point transfers (``tapped.TAPPED``, its
``torch.distributed.distributed_c10d`` rows), wrapped once per process to report each call to
the watching ledgers (``ledger.CommLedger``): its launch, payload and completion (on return
when blocking, by a callback on its ``Work``'s future when asynchronous; on a GPU, by CUDA
events). The calls DDP comm hooks, FSDP, DeepSpeed, ``torch.distributed.pipelining`` and user
code make all pass through them.

An asynchronous transfer's ``Work`` is remembered until the training thread waits on it:
``Work.wait`` is wrapped too, and a wait on a transfer's work is how long the transfer held
the thread up (a wait on a receive is a pipeline stage's bubble). A ``batch_isend_irecv``
reports each of its ``P2POp``s, its inner ``isend``/``irecv`` calls passing straight through.

The wrapped functions cost a check of one list when no monitor is watching.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from time import perf_counter, thread_time
from typing import Any

from gpumon.client.comm.ledger import CommLedger
from gpumon.client.comm.ops import Op, record_event
from gpumon.client.comm.tapped import C10D, RECEIVES, rows
from gpumon.client.core.comm_inflight import IN_FLIGHT, STEP_OPENERS, open_step_for_transfer

log = logging.getLogger("gpumon.client")

MAX_WAITED_WORKS = 4096
"""Transfers' works remembered until waited on; beyond, the oldest are forgotten (a work the
job never waits on, an ``isend`` it lets go, must not grow memory)."""

WRAPPED_MARK = "__gpumon_wrapped__"
"""The attribute that marks a function as one of these wrappers (so a second copy of this
module, or a reload, never wraps a wrapper)."""

_ledgers: list[CommLedger] = []
"""The ledgers the wrapped functions report to (one per watching monitor, usually one)."""
_installed = False
_install_lock = threading.Lock()
_inside = threading.local()
"""``collective`` is True on a thread inside a wrapped function: one that calls another
(torch's ``all_gather_into_tensor`` calls ``all_gather_single``; ``batch_isend_irecv`` calls
``isend`` and ``irecv``) is one operation, counted once."""
_works: OrderedDict[int, tuple[Any, bool, bool, list[Op], tuple[int, ...]]] = OrderedDict()
"""id(work) -> (the work, a receive?, on a GPU?, its operations in the ledgers, its
``IN_FLIGHT`` numbers to end at its wait) of each transfer not waited on yet."""


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
    """Wrap the collectives and transfers of ``torch.distributed`` once per process, and the
    functional collectives (``functional``) where this torch has them."""
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
        originals: dict[str, Callable[..., Any]] = {}
        for row in rows(C10D):
            original = getattr(distributed_c10d, row.function, None)
            if original is None or getattr(original, WRAPPED_MARK, False):
                continue  # not in this torch version: not measured
            originals[row.function] = original
            if row.function == "batch_isend_irecv":
                wrapped = _wrap_batch(original)
            else:
                wrapped = _wrap(original, row.op, row.position, row.keyword)
            setattr(distributed_c10d, row.function, wrapped)
            if getattr(dist, row.function, None) is original:
                setattr(dist, row.function, wrapped)
        _wrap_work_wait(distributed_c10d)
        _swap_p2p_ops.update({originals[name]: getattr(distributed_c10d, name)
                              for name in ("isend", "irecv") if name in originals})
        from gpumon.client.comm.functional import install_functional

        install_functional(_ledgers, _inside)
        _installed = True
        return True


_swap_p2p_ops: dict[Callable[..., Any], Callable[..., Any]] = {}
"""The unwrapped ``isend``/``irecv`` -> their wrappers: a ``P2POp`` made before the tap names the
function it was given, and ``batch_isend_irecv`` tells a send from a receive by identity."""


def _wrap(original: Callable[..., Any], name: str, position: int, keyword: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if not _ledgers or getattr(_inside, "collective", False):
            return original(*args, **kwargs)
        payload = _payload(args, kwargs, position, keyword)
        close = open_step_for_transfer() if STEP_OPENERS and name in _TRANSFERS else None
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
            if close is not None:
                close()
        t1, c1 = perf_counter(), thread_time()
        try:
            asynchronous = name in _TRANSFERS and hasattr(result, "wait")  # isend, irecv
            if asynchronous and _on_host(payload):
                _transfer(name, payload, seq, t0, t1, result, (c0, c1))
            else:
                _follow(seq, payload, result)
                ops = _record(name, payload, t0, t1, result, (c0, c1))
                if asynchronous:
                    _remember(result, name in RECEIVES, payload, ops)
        except Exception:  # measuring must never break the collective
            log.debug("gpumon: could not record a %s", name, exc_info=True)
        return result

    setattr(collective, WRAPPED_MARK, True)
    return collective


_TRANSFERS = frozenset({"send", "recv"})


def _on_host(payload: Any) -> bool:
    return all(t.device.type == "cpu" for t in _tensors(payload))


def _transfer(name: str, payload: Any, seq: int, t0: float, t1: float, work: Any,
              cpu: tuple[float, float]) -> None:
    """An asynchronous transfer on the host: complete, to the ledgers and ``IN_FLIGHT``, when
    the training thread's wait on its work returns (a future's callback would cost a hand-over
    of the GIL from the backend's thread on every transfer), at its launch until then."""
    ops = _record(name, payload, t0, t1, None, cpu, receiving=False)
    _remember(work, name in RECEIVES, payload, ops, seq)


def _wrap_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    """``batch_isend_irecv``: each ``P2POp`` is one transfer, its ``Work`` (one per op, or one
    for the batch where the backend coalesces) remembered for the wait."""

    @functools.wraps(original)
    def batch_isend_irecv(p2p_op_list: Any) -> Any:
        try:
            for p2p in p2p_op_list:  # made before the tap: name the wrapper, as the batch will
                swapped = _swap_p2p_ops.get(p2p.op)
                if swapped is not None:
                    p2p.op = swapped
        except Exception:
            pass
        if not _ledgers or getattr(_inside, "collective", False):
            return original(p2p_op_list)
        kinds = [(_kind_of(p2p), p2p.tensor) for p2p in p2p_op_list]
        close = open_step_for_transfer() if STEP_OPENERS else None
        seqs = [_opened(name, tensor) for name, tensor in kinds]
        c0, t0 = thread_time(), perf_counter()
        _inside.collective = True
        try:
            works = original(p2p_op_list)
        except BaseException:
            for seq in seqs:
                IN_FLIGHT.end(seq)
            raise
        finally:
            _inside.collective = False
            if close is not None:
                close()
        t1, c1 = perf_counter(), thread_time()
        try:
            per_op = list(works) if works is not None and len(works) == len(kinds) \
                else [works[0] if works else None] * len(kinds)
            ops_of: dict[int, list[Op]] = {}
            seqs_of: dict[int, list[int]] = {}
            host = _on_host([tensor for _, tensor in kinds])
            for (name, tensor), seq, work in zip(kinds, seqs, per_op, strict=True):
                if host:  # completed by the wait on its work (``_transfer``)
                    ops = _record(name, tensor, t0, t1, None, (c0, c1), receiving=False)
                    if work is None:  # no work to wait on: nothing will say more
                        IN_FLIGHT.end(seq)
                else:
                    _follow(seq, tensor, work)
                    ops = _record(name, tensor, t0, t1, work, (c0, c1))
                ops_of.setdefault(id(work), []).extend(ops)
                seqs_of.setdefault(id(work), []).append(seq)
            receiving = any(name in RECEIVES for name, _ in kinds)
            for work in dict.fromkeys(w for w in per_op if w is not None):
                _remember(work, receiving, [tensor for _, tensor in kinds], ops_of[id(work)],
                          *(seqs_of[id(work)] if host else ()))
        except Exception:
            log.debug("gpumon: could not record a batch of transfers", exc_info=True)
        return works

    setattr(batch_isend_irecv, WRAPPED_MARK, True)
    return batch_isend_irecv


def _kind_of(p2p: Any) -> str:
    name = getattr(p2p.op, "__name__", "")
    return "recv" if name in ("irecv", "recv") else "send"


def _remember(work: Any, receiving: bool, payload: Any, ops: list[Op], *seqs: int) -> None:
    """Keep a transfer's work until the training thread waits on it (``ops``: what the
    ledgers recorded of it, complete at the latest when the wait returns; ``seqs``: its
    ``IN_FLIGHT`` numbers, ended then, where no future's callback ends them)."""
    _works[id(work)] = (work, receiving, not _on_host(payload), ops, seqs)
    if len(_works) > MAX_WAITED_WORKS:  # (each a single dict operation: no lock needed)
        _, (_, _, _, _, forgotten) = _works.popitem(last=False)
        for seq in forgotten:
            IN_FLIGHT.end(seq)


def _wrap_work_wait(distributed_c10d: Any) -> None:
    """``Work.wait``: a wait on a remembered transfer is reported to the ledgers as the
    training thread held up (a receive's as its bubble); any other wait passes through."""
    work_type = getattr(distributed_c10d, "Work", None)
    original = getattr(work_type, "wait", None)
    if work_type is None or original is None or getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _works:
            return original(self, *args, **kwargs)
        entry = _works.pop(id(self), None)
        if entry is None or entry[0] is not self or not _ledgers:
            return original(self, *args, **kwargs)
        _, receiving, on_device, ops, seqs = entry
        close = open_step_for_transfer() if STEP_OPENERS else None
        tails = []
        for ledger in _ledgers:
            clock = ledger.device_clock() if on_device and ledger.in_step else None
            if clock is not None:
                tail = ledger.wait_from(perf_counter(), receiving=receiving)
                if tail is not None:
                    tail.waiting()
                    tails.append(tail)
        c0, t0 = thread_time(), perf_counter()
        try:
            result = original(self, *args, **kwargs)
        finally:
            if close is not None:
                close()
        t1, c1 = perf_counter(), thread_time()
        try:
            for tail in tails:
                tail.resumed()
            for op in ops:  # a backend's future may run its callback before the data is in
                op.t_done = max(op.t_done or t1, t1)
            for seq in seqs:
                IN_FLIGHT.end(seq)
            if not on_device:
                for ledger in _ledgers:
                    ledger.blocked(t0, t1, (c0, c1), receiving=receiving)
        except Exception:
            log.debug("gpumon: could not record a wait", exc_info=True)
        return result

    setattr(wait, WRAPPED_MARK, True)
    try:
        work_type.wait = wait
    except (AttributeError, TypeError):  # a Work type that takes no attributes: waits unseen
        log.debug("gpumon: Work.wait cannot be wrapped: transfers' waits not measured")


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
            cpu: tuple[float, float] | None = None, receiving: bool | None = None) -> list[Op]:
    """Report a call to every ledger; the host-timed operations it made there. ``receiving``:
    its call on the training thread was a wait to receive (by default: a blocking ``recv``)."""
    tensors = _tensors(payload)
    nbytes = _nbytes(tensors)
    host_timed = all(t.device.type == "cpu" for t in tensors)
    ops = []
    for ledger in _ledgers:
        clock = ledger.device_clock() if not host_timed and ledger.in_step else None
        get_future = getattr(result, "get_future", None)
        if clock is not None and get_future is not None:
            _record_on_device(ledger, clock, name, nbytes, t0, t1, get_future)
            continue
        op = ledger.launched(name, nbytes, t0, t1, host_timed, cpu,
                             receiving=name in RECEIVES and get_future is None
                             if receiving is None else receiving)
        if op is None:
            continue
        ops.append(op)
        if get_future is None:  # returned after completing (or not part of the group)
            op.t_done = t1
            continue
        try:
            future = get_future()
            op.future = future
            future.add_done_callback(op.done)
        except RuntimeError:  # this backend gives no future for this op: completion unknown
            op.future = None
            op.t_done = t1
    return ops


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
