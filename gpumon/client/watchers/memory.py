"""The live memory breakdown of a watched model: what this rank's memory is made of.

``watch(model, optimizer)`` registers a ``MemoryBreakdownSampler`` on the monitor. On a sampled
step it adds a ``memb`` field to the step's record with, in bytes:

* ``parameters``: every parameter's storage, once (shared and tied weights are one storage),
  plus copies of weights that autograd saved for backward and that still hold memory when
  backward starts (an autocast cast of a weight is still the weight, not an activation; FSDP's
  unsharded weights, freed after forward, are not held); under FSDP, this rank's shards;
* ``gradients``: the gradients' storages, read when the backward pass ends (queued on
  autograd's engine), so a loop that zeroes them after the optimizer step still shows them;
* ``optimizer_states``: every tensor in ``optimizer.state`` (any optimizer), plus parameters
  the optimizer updates that the model does not hold — the fp32 master copy of a bf16/fp16
  model, counted here as the ZeRO paper's K = 12 counts it;
* ``activations``: what autograd keeps for backward, from ``saved_tensors_hooks`` — the
  unique storages saved between a forward's start and its backward's start, not counting
  parameters (weights saved for backward are parameters); with several forwards in a step
  (gradient accumulation), the largest;
* ``other``: with CUDA, what the caching allocator reserves beyond the named parts (buffers,
  workspaces, fragmentation), read at the forward→backward boundary, when activations are
  alive; without CUDA, where no allocator can be read, the storages earlier sampled steps
  saved for backward that are still alive — a lower bound of a leak that keeps activations
  alive across steps (only sampled steps are tracked).

What is sampled and why: the first step, then the first step that starts at least
``interval_s`` (5 s) after the previous sample. An unsampled step calls nothing here: the
sampler tells the monitor when its next sample is due (``quiet_until``), and the core calls no
extension before then, so a watched loop's unsampled steps cost what unwatched ones do; a
sampled one walks the parameters, gradients and optimizer states and runs a Python hook for
every tensor saved for backward: negligible once every few seconds, not once per step (both
measured in benchmarks/RESULTS.md §10 and §11). Memory changes over many steps, so
seconds between samples lose nothing an out-of-memory warning needs.

Saved-tensor hooks keep a graph's saved outputs alive through a reference cycle if that
graph is dropped without a backward pass (PyTorch's behaviour with any such hook). So a
sampled step with a forward but no backward stops activation sampling for good: at most one
step's activations are ever held that way.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Callable, Iterable
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from gpumon.client.core.seam import Watched

SAMPLE_INTERVAL_S = 5.0
INTERVAL_ENV = "GPUMON_MEMORY_SAMPLE_S"
"""Seconds between sampled steps, when not the default (0: every step, for experiments)."""
RETAINED_SAMPLES = 64
"""Sampled steps whose saved tensors are watched for still being alive (the CPU ``other``)."""

Key = tuple[int, torch.device]


class Holdings(Protocol):
    """What a wrapper keeps outside its model's ``param.data`` and ``param.grad`` (ZeRO's
    partitions: ``deepspeed_memory``), read at each sampled step."""

    def parameters(self) -> Iterable[torch.Tensor]: ...

    def gradients(self) -> Iterable[torch.Tensor]: ...

    def optimizer_states(self) -> Iterable[torch.Tensor]:
        """Fp32 master partitions the optimizer updates but does not list between steps."""
        ...

    def buffers(self) -> Iterable[torch.Tensor]:
        """Communication buffers (reduction buckets): counted in ``other``."""
        ...


def watch_memory(monitor: Watched, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None,
                 holdings: Holdings | None = None) -> MemoryBreakdownSampler:
    """The monitor's sampler, registered as a step extension on first use, now also watching
    ``model``, ``optimizer`` and ``holdings`` (again: nothing changes)."""
    sampler = monitor.extensions.attach(
        MemoryBreakdownSampler, lambda: MemoryBreakdownSampler(interval_s=_interval_from_env()))
    sampler.add(model, optimizer, holdings)
    return sampler


def _interval_from_env() -> float:
    text = os.environ.get(INTERVAL_ENV)
    if text is None:
        return SAMPLE_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        logging.getLogger("gpumon.client").warning(
            "gpumon: %s=%r is not a number of seconds >= 0; sampling every %.0f s",
            INTERVAL_ENV, text, SAMPLE_INTERVAL_S)
        return SAMPLE_INTERVAL_S
    return value


class MemoryBreakdownSampler:
    """A step extension measuring the breakdown of the memory of the models and optimizers
    ``add``ed to it (several: a GAN's two, a model watched before its optimizer exists).

    Holds them weakly: a sampler never keeps a model alive.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 *, interval_s: float = SAMPLE_INTERVAL_S,
                 clock: Callable[[], float] = perf_counter) -> None:
        self._models: list[weakref.ref[torch.nn.Module]] = []
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._holdings: list[Holdings] = []
        if model is not None:
            self.add(model, optimizer)
        self._interval_s = interval_s
        self._clock = clock
        self._next_t = float("-inf")
        self._sampling = False
        self._activations_enabled = True
        self._hooks: Any = None
        self._param_keys: set[Key] = set()
        self._param_tensors: set[int] = set()
        self._segment: dict[Key, int] = {}
        self._weight_copies: dict[Key, int] = {}  # as alive at the forward→backward boundary
        self._copy_refs: list[tuple[weakref.ref[torch.Tensor], Key]] = []
        self._in_backward = False
        self._backward_seen = False
        self._activations = 0
        self._gradients = 0
        self._boundary: tuple[int, int] | None = None  # (reserved, named bytes) with CUDA
        self._saved: list[tuple[weakref.ref[torch.Tensor], Key, int]] = []
        self._earlier: list[list[tuple[weakref.ref[torch.Tensor], Key, int]]] = []
        self._retained: dict[Key, int] | None = None
        self.samples = 0

    def add(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            holdings: Holdings | None = None) -> None:
        """Watch ``model`` (and ``optimizer``, and a wrapper's ``holdings``) too; what is
        watched already is not added twice."""
        for ref, obj in ((self._models, model), (self._optimizers, optimizer)):
            if obj is not None and not any(r() is obj for r in ref):
                ref.append(weakref.ref(obj))
        if holdings is not None and not any(h is holdings for h in self._holdings):
            self._holdings.append(holdings)

    def _live(self) -> tuple[Model, list[torch.optim.Optimizer]] | None:
        models = [m for m in (r() for r in self._models) if m is not None]
        if not models:
            return None
        return Model(models), [o for o in (r() for r in self._optimizers) if o is not None]

    def quiet_until(self) -> float:
        """When the next sample is due (``perf_counter``): until then the core need not call
        this sampler (``extensions``), so an unsampled step costs it nothing."""
        return self._next_t if self._clock is perf_counter and not self._sampling else -math.inf

    def step_begin(self) -> None:
        """Start a sample if one is due (the only work on most steps: a clock read)."""
        now = self._clock()
        if now < self._next_t:
            return
        live = self._live()
        if live is None:
            return
        model, optimizers = live
        self._next_t = now + self._interval_s
        self._sampling = True
        self._in_backward = self._backward_seen = False
        self._activations = self._gradients = 0
        self._segment, self._weight_copies, self._saved = {}, {}, []
        self._copy_refs = []
        self._boundary = None
        params = [*model.parameters(), *_updated(optimizers), *self._held("parameters")]
        self._param_tensors = {id(p) for p in params}
        self._param_keys = {key for key, _ in (_storage(p) for p in params) if key is not None}
        self._retained = self._still_alive() if self._earlier else None
        if self._activations_enabled:
            try:
                self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                self._hooks.__enter__()
            except RuntimeError:  # saved-tensor hooks disabled here (some wrappers do)
                self._hooks = None

    def step_end(self, fields: dict[str, object]) -> None:
        """Finish a sample: put the breakdown into the step's ``memb`` field."""
        if not self._sampling:
            return
        self._sampling = False
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
            if not self._backward_seen and self._segment:
                self._activations_enabled = False  # see the module docstring
        live = self._live()
        if live is None:
            return
        model, optimizers = live
        if not self._backward_seen:
            self._weight_copies.update(self._alive_copies())
        seen: set[Key] = set()
        parameters = _unique_bytes([*model.parameters(), *self._held("parameters")], seen)
        parameters += sum(n for k, n in self._weight_copies.items() if k not in seen)
        seen.update(self._weight_copies)
        buffers = _unique_bytes(self._held("buffers"), seen)
        gradients = max(self._gradients,
                        _unique_bytes([*_grads(model, optimizers), *self._held("gradients")], seen))
        breakdown: dict[str, int] = {"parameters": parameters, "gradients": gradients}
        if optimizers:
            breakdown["optimizer_states"] = _unique_bytes(
                [*_optimizer_tensors(model, optimizers), *self._held("optimizer_states")], seen)
        if hooks is not None:
            breakdown["activations"] = self._activations or sum(self._segment.values())
        if self._boundary is not None:
            reserved, named = self._boundary
            breakdown["other"] = max(0, reserved - named - breakdown.get("activations", 0))
        elif self._retained is not None or buffers:
            retained = self._retained or {}
            breakdown["other"] = buffers + sum(n for k, n in retained.items() if k not in seen)
        fields["memb"] = breakdown
        if self._saved:
            self._earlier.append(self._saved)
            del self._earlier[:-RETAINED_SAMPLES]
        self._saved, self._copy_refs = [], []
        self._segment = {}
        self.samples += 1

    # --- autograd hooks: only on a sampled step -------------------------------------------

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._in_backward:  # a forward after a backward: the next micro-batch
            self._in_backward = False
            self._segment = {}
        if id(tensor) not in self._param_tensors:
            key, nbytes = _storage(tensor)
            if key is not None and key not in self._param_keys:
                if _is_weight_copy(tensor, self._param_tensors):
                    base = tensor._base if tensor._base is not None else tensor
                    self._copy_refs.append((weakref.ref(base), key))
                else:
                    self._segment[key] = nbytes
                    # A view dies with the graph even when what it views is kept (a list
                    # holding the layer's output): watch the tensor that owns the storage.
                    base = tensor._base if tensor._base is not None else tensor
                    self._saved.append((weakref.ref(base), key, nbytes))
        return tensor

    def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._in_backward and self._sampling:
            self._in_backward = self._backward_seen = True
            self._activations = max(self._activations, sum(self._segment.values()))
            self._weight_copies.update(self._alive_copies())
            if tensor.device.type == "cuda":
                self._read_boundary(tensor.device)
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            except RuntimeError:  # unpacked outside a backward pass
                pass
        return tensor

    def _read_boundary(self, device: torch.device) -> None:
        """With CUDA, the allocator's reservation and the named parts alive right now."""
        live = self._live()
        if live is None:
            return
        model, optimizers = live
        seen: set[Key] = set()
        named = _unique_bytes([*model.parameters(), *self._held("parameters")], seen)
        named += _unique_bytes([*_grads(model, optimizers), *self._held("gradients")], seen)
        named += _unique_bytes([*_optimizer_tensors(model, optimizers),
                                *self._held("optimizer_states")], seen)
        named += sum(n for k, n in self._weight_copies.items() if k not in seen)
        self._boundary = (torch.cuda.memory_reserved(device), named)

    def backward_done(self) -> None:
        """A wrapper's backward returned (DeepSpeed reduces gradients into its partitions
        after autograd's pass, and frees them in the optimizer step): read the gradients
        again, on a sampled step."""
        if self._sampling:
            self._after_backward()

    def _after_backward(self) -> None:
        live = self._live()
        if live is not None:
            model, optimizers = live
            seen: set[Key] = set()
            _unique_bytes([*model.parameters(), *self._held("parameters"), *self._held("buffers")], seen)
            grads = [*_grads(model, optimizers), *self._held("gradients")]
            self._gradients = max(self._gradients, _unique_bytes(grads, seen))

    def _held(self, part: str) -> list[torch.Tensor]:
        """The holdings' tensors of ``part`` (``parameters``, ``gradients``, ``buffers``)."""
        tensors: list[torch.Tensor] = []
        for holdings in self._holdings:
            tensors.extend(getattr(holdings, part)())
        return tensors

    def _alive_copies(self) -> dict[Key, int]:
        """The weight copies saved for backward whose storage still holds them: FSDP frees its
        unsharded weights after forward (their storage resized to nothing) and gathers them
        again for backward; an autocast cast stays until backward."""
        alive: dict[Key, int] = {}
        for ref, key in self._copy_refs:
            tensor = ref()
            if tensor is not None:
                _, nbytes = _storage(tensor)
                if nbytes:
                    alive[key] = nbytes
        return alive

    def _still_alive(self) -> dict[Key, int]:
        alive: dict[Key, int] = {}
        for saved in self._earlier:
            saved[:] = [entry for entry in saved if entry[0]() is not None]
            for _, key, nbytes in saved:
                alive[key] = nbytes
        self._earlier = [saved for saved in self._earlier if saved]
        return alive


class Model:
    """The watched models as one: their parameters, each once."""

    def __init__(self, models: list[torch.nn.Module]) -> None:
        self._models = models

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        """Every parameter of every model, once."""
        seen: set[int] = set()
        for model in self._models:
            for p in model.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p


def _storage(tensor: torch.Tensor) -> tuple[Key | None, int]:
    """(storage identity, its bytes), or ``(None, 0)`` for tensors without a plain storage."""
    local = getattr(tensor, "_local_tensor", None)  # a DTensor (FSDP2): this rank's shard
    if isinstance(local, torch.Tensor):
        tensor = local
    try:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or tensor.device.type == "meta":
            return None, 0
        return (storage.data_ptr(), tensor.device), nbytes
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, fake tensors
        return None, 0


def _unique_bytes(tensors: Iterable[torch.Tensor], seen: set[Key]) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (which gains them)."""
    total = 0
    for tensor in tensors:
        key, nbytes = _storage(tensor)
        if key is not None and key not in seen:
            seen.add(key)
            total += nbytes
    return total


def _updated(optimizers: list[torch.optim.Optimizer]) -> Iterable[torch.Tensor]:
    """The parameters the optimizers update."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            yield from group["params"]


def _grads(model: Model, optimizers: list[torch.optim.Optimizer]) -> Iterable[torch.Tensor]:
    for p in (*model.parameters(), *_updated(optimizers)):
        if p.grad is not None:
            yield p.grad


def _optimizer_tensors(model: Model,
                       optimizers: list[torch.optim.Optimizer]) -> Iterable[torch.Tensor]:
    """Every tensor of the optimizers' state, then the parameters they update that no watched
    model holds (fp32 master copies)."""
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value
    own = {id(p) for p in model.parameters()}
    for p in _updated(optimizers):
        if id(p) not in own:
            yield p


def _is_weight_copy(tensor: torch.Tensor, params: set[int]) -> bool:
    """Whether ``tensor`` is a copy of a weight: a parameter the module swapped in for the
    ones it registers (FSDP's all-gathered, unsharded weights), a cast of a parameter
    (autocast's low-precision copy), or a view of either (a matmul saves the transposed one)."""
    base = tensor._base if tensor._base is not None else tensor
    if isinstance(base, torch.nn.Parameter):
        return True
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    for next_fn, _ in fn.next_functions:
        variable = getattr(next_fn, "variable", None)
        if variable is not None and id(variable) in params:
            return True
    return False
