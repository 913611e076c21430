"""Checkpoint saves and restores, and evaluation passes, recognised in an unmodified job: the
functions that write and read checkpoints, wrapped once per process, report each outermost
call on the training thread as a span (``core/spans.py``) to every watching monitor.

What is wrapped (``TAPS``), as each module is imported (a module already imported at once):
``torch.save`` and ``torch.load``; ``torch.distributed.checkpoint``'s ``save``, ``async_save``
and ``load``; safetensors' ``save_file``, ``save_model`` and ``load_file``; Hugging Face
``Trainer._save_checkpoint``, ``_load_from_checkpoint`` and ``evaluate``; accelerate's
``save_state`` and ``load_state``; DeepSpeed's ``save_checkpoint`` and ``load_checkpoint``;
Lightning's ``Trainer.save_checkpoint`` and its evaluation loop.

Which calls count (docs/goodput.md#what-counts-as-a-checkpoint): a framework's checkpoint call
and a distributed checkpoint always; a bare ``torch.save``, ``torch.load`` or safetensors call
only when what it writes or reads holds at least ``MIN_CHECKPOINT_BYTES`` of tensors or an
optimizer's state — a metrics file, a config or a small tensor is not a checkpoint. A call
inside another (DeepSpeed's ``torch.save`` inside its ``save_checkpoint``) is part of the outer
one. A call that raises is a failed checkpoint: no preserved point. An asynchronous save counts
the time it held the training thread; its completion (or failure) is reported when its future
completes. Calls from other threads (a background writer) are not the training thread's time.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from time import perf_counter
from types import ModuleType
from typing import Any

from gpumon.client.core.spans import SpanReporter, on_training_thread

log = logging.getLogger("gpumon.client")

MIN_CHECKPOINT_BYTES = 1 << 20
"""A bare ``torch.save``/``torch.load``/safetensors call counts from this much tensor data."""

WRAPPED_MARK = "__gpumon_checkpoint__"

_reporters: weakref.WeakSet[SpanReporter] = weakref.WeakSet()
_early: deque[tuple[str, float, bool, str, int | None]] = deque(maxlen=16)
"""Spans before the process had a monitor (``gpumon run`` makes it at the first training step:
a restore comes before), told to the first one (their time is the rank's startup)."""
_inside = threading.local()
_install_lock = threading.Lock()
_patched: set[str] = set()


class Tap:
    """One function to wrap: where (``module``, ``owner`` — a class in it, or None for the
    module itself — and ``name``), what span it is and through which API; ``always``: every
    call counts (else only one holding a checkpoint's worth of tensors); ``sized``: which
    argument (an index) or the result (``"result"``) holds what is written or read."""

    def __init__(self, module: str, owner: str | None, name: str, kind: str, api: str,
                 always: bool, sized: int | str | None = None, asynchronous: bool = False) -> None:
        self.module, self.owner, self.name = module, owner, name
        self.kind, self.api, self.always, self.sized = kind, api, always, sized
        self.asynchronous = asynchronous


TAPS: tuple[Tap, ...] = (
    Tap("torch", None, "save", "save", "torch.save", False, sized=0),
    Tap("torch", None, "load", "load", "torch.load", False, sized="result"),
    Tap("torch.distributed.checkpoint", None, "save", "save", "dcp", True),
    Tap("torch.distributed.checkpoint", None, "async_save", "save", "dcp", True,
        asynchronous=True),
    Tap("torch.distributed.checkpoint", None, "load", "load", "dcp", True),
    Tap("safetensors.torch", None, "save_file", "save", "safetensors", False, sized=0),
    Tap("safetensors.torch", None, "save_model", "save", "safetensors", True),
    Tap("safetensors.torch", None, "load_file", "load", "safetensors", False, sized="result"),
    Tap("transformers.trainer", "Trainer", "_save_checkpoint", "save", "hf", True),
    Tap("transformers.trainer", "Trainer", "_load_from_checkpoint", "load", "hf", True),
    Tap("transformers.trainer", "Trainer", "evaluate", "eval", "hf", True),
    Tap("accelerate.accelerator", "Accelerator", "save_state", "save", "accelerate", True),
    Tap("accelerate.accelerator", "Accelerator", "load_state", "load", "accelerate", True),
    Tap("deepspeed.runtime.engine", "DeepSpeedEngine", "save_checkpoint", "save", "deepspeed",
        True),
    Tap("deepspeed.runtime.engine", "DeepSpeedEngine", "load_checkpoint", "load", "deepspeed",
        True),
    Tap("lightning.pytorch.trainer.trainer", "Trainer", "save_checkpoint", "save", "lightning",
        True),
    Tap("pytorch_lightning.trainer.trainer", "Trainer", "save_checkpoint", "save", "lightning",
        True),
    Tap("lightning.pytorch.loops.evaluation_loop", "_EvaluationLoop", "run", "eval",
        "lightning", True),
    Tap("pytorch_lightning.loops.evaluation_loop", "_EvaluationLoop", "run", "eval",
        "lightning", True),
)


def watch_checkpoints(reporter: SpanReporter | None) -> None:
    """Report this process's checkpoints and evaluations to ``reporter`` from now on (None:
    wrap the functions now, and keep what they see for the first monitor)."""
    if reporter is not None:
        _reporters.add(reporter)
        while _early:
            kind, seconds, ok, api, nbytes = _early.popleft()
            reporter.report(kind, seconds, ok, steps=0, api=api, nbytes=nbytes)
    with _install_lock:
        if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
        for module in {tap.module for tap in TAPS}:
            if module in sys.modules:
                _patch_module(module, sys.modules[module])


def tensor_bytes(value: object, depth: int = 6, budget: list[int] | None = None) -> tuple[int, bool]:
    """(bytes of tensor data in ``value``, whether it holds an optimizer's state), looking
    through dicts, lists and tuples ``depth`` levels down and at most ~100,000 items."""
    budget = budget if budget is not None else [100_000]
    budget[0] -= 1
    if budget[0] < 0 or depth < 0:
        return 0, False
    nbytes = getattr(value, "nbytes", None)
    if type(nbytes) is int and hasattr(value, "element_size"):
        return nbytes, False
    total, optimizer = 0, False
    if isinstance(value, dict):
        optimizer = "state" in value and "param_groups" in value
        items: Sequence[object] = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return 0, False
    for item in items:
        size, opt = tensor_bytes(item, depth - 1, budget)
        total, optimizer = total + size, optimizer or opt
    return total, optimizer


def _wrap(tap: Tap, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "depth", False) or not on_training_thread():
            return fn(*args, **kwargs)
        steps = _steps()
        _inside.depth = True
        began = perf_counter()
        ok = False
        result: Any = None
        try:
            result = fn(*args, **kwargs)
            ok = True
            return result
        finally:
            _inside.depth = False
            seconds = perf_counter() - began
            try:
                _report(tap, args, kwargs, result, ok, seconds, steps)
            except Exception:  # a failure here costs the span, never the job's call
                log.debug("checkpoint span not reported", exc_info=True)

    setattr(wrapper, WRAPPED_MARK, True)
    return wrapper


def _report(tap: Tap, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any, ok: bool,
            seconds: float, steps: int | None) -> None:
    nbytes = None
    if tap.sized is not None:
        if tap.sized == "result" and not ok:
            return  # a read that failed: what it would have held is not known
        if tap.sized == "result":
            held = result
        elif isinstance(tap.sized, int) and len(args) > tap.sized:
            held = args[tap.sized]
        else:
            held = kwargs.get("obj", kwargs.get("tensors"))
        nbytes, optimizer = tensor_bytes(held)
        if not tap.always and not optimizer and nbytes < MIN_CHECKPOINT_BYTES:
            return
    pending = tap.asynchronous and ok
    if not _reporters:
        if not pending:
            _early.append((tap.kind, seconds, ok, tap.api, nbytes))
        return
    for reporter in list(_reporters):
        reporter.report(tap.kind, seconds, None if pending else ok, steps=steps, api=tap.api,
                        nbytes=nbytes, pending=pending)
    if pending:
        _when_written(result, tap, steps)


def _when_written(result: Any, tap: Tap, steps: int | None) -> None:
    """Report an asynchronous save's outcome when its future completes (on whatever thread
    completes it)."""
    future = getattr(result, "upload_completion", result)  # AsyncSaveResponse, or a Future
    began = perf_counter()

    def done(fut: Any) -> None:
        try:
            ok = fut.exception() is None
        except Exception:
            ok = False
        for reporter in list(_reporters):
            reporter.report("saved", perf_counter() - began, ok, steps=steps, api=tap.api)

    add = getattr(future, "add_done_callback", None)
    if add is None:  # not a future we know: its outcome is not known, nothing is preserved
        return
    add(done)


def _steps() -> int | None:
    for reporter in list(_reporters):
        if not reporter.closed:
            return reporter.steps()
    return None


def _patch_module(name: str, module: ModuleType) -> None:
    """Wrap every tap of ``name`` not wrapped yet (a target still missing — a module caught
    half imported — is tried again at the next monitor)."""
    if name in _patched:
        return
    complete = True
    for tap in TAPS:
        if tap.module != name:
            continue
        owner: Any = module if tap.owner is None else getattr(module, tap.owner, None)
        fn = getattr(owner, tap.name, None) if owner is not None else None
        if fn is None:
            complete = False
            continue
        if getattr(fn, WRAPPED_MARK, False):
            continue
        try:
            setattr(owner, tap.name, _wrap(tap, fn))
        except (AttributeError, TypeError):
            log.debug("cannot wrap %s.%s", name, tap.name)
    if complete:
        _patched.add(name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps a tapped module's functions right after it is first imported: a finder first on
    ``sys.meta_path`` that finds nothing itself, asks the others, and wraps the loader's
    ``exec_module`` of the modules in ``TAPS``."""

    _modules = frozenset(tap.module for tap in TAPS)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self._modules or fullname in _patched:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            with _install_lock:
                _patch_module(fullname, module)

        try:
            loader.exec_module = exec_then_patch  # type: ignore[union-attr,method-assign]
        except AttributeError:
            return spec
        return spec
