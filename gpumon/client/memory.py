"""The live memory breakdown of a watched model: what this rank's memory is made of.

``watch(model, optimizer)`` registers a ``MemoryBreakdownSampler`` on the monitor. On a sampled
step it adds a ``memb`` field to the step's record with, in bytes:

* ``parameters``: every parameter's storage, once (shared and tied weights are one storage),
  plus low-precision working copies of weights that autograd saved for backward (an autocast
  cast of a weight is still the weight, not an activation);
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
``interval_s`` (5 s) after the previous sample. An unsampled step costs two method calls
and one clock read; a sampled one walks the parameters, gradients and optimizer states and
runs a Python hook for every tensor saved for backward — hundreds of microseconds on a small
model (``benchmarks/bench_hook.py`` measures both), negligible once every few seconds, not
once per step. Memory changes over many steps, so seconds between samples lose nothing an
out-of-memory warning needs.

Saved-tensor hooks keep a graph's saved outputs alive through a reference cycle if that
graph is dropped without a backward pass (PyTorch's behaviour with any such hook). So a
sampled step with a forward but no backward stops activation sampling for good: at most one
step's activations are ever held that way.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from time import perf_counter
from typing import Any

import torch

SAMPLE_INTERVAL_S = 5.0
RETAINED_SAMPLES = 64
"""Sampled steps whose saved tensors are watched for still being alive (the CPU ``other``)."""

Key = tuple[int, torch.device]


class MemoryBreakdownSampler:
    """A step extension measuring the breakdown of ``model``'s (and ``optimizer``'s) memory.

    Holds the model and the optimizer weakly: a sampler never keeps a model alive.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, interval_s: float = SAMPLE_INTERVAL_S,
                 clock: Callable[[], float] = perf_counter) -> None:
        self._model = weakref.ref(model)
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)
        self._interval_s = interval_s
        self._clock = clock
        self._next_t = float("-inf")
        self._sampling = False
        self._activations_enabled = True
        self._hooks: Any = None
        self._param_keys: set[Key] = set()
        self._param_tensors: set[int] = set()
        self._segment: dict[Key, int] = {}
        self._weight_copies: dict[Key, int] = {}
        self._in_backward = False
        self._backward_seen = False
        self._activations = 0
        self._gradients = 0
        self._boundary: tuple[int, int] | None = None  # (reserved, named bytes) with CUDA
        self._saved: list[tuple[weakref.ref[torch.Tensor], Key, int]] = []
        self._earlier: list[list[tuple[weakref.ref[torch.Tensor], Key, int]]] = []
        self._retained: dict[Key, int] | None = None
        self.samples = 0

    def step_begin(self) -> None:
        """Start a sample if one is due (the only work on most steps: a clock read)."""
        now = self._clock()
        if now < self._next_t:
            return
        model = self._model()
        if model is None:
            return
        self._next_t = now + self._interval_s
        self._sampling = True
        self._in_backward = self._backward_seen = False
        self._activations = self._gradients = 0
        self._segment, self._weight_copies, self._saved = {}, {}, []
        self._boundary = None
        params = list(_parameters(model, self._optimizer))
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
        model = self._model()
        if model is None:
            return
        optimizer = None if self._optimizer is None else self._optimizer()
        seen: set[Key] = set()
        parameters = _unique_bytes(model.parameters(), seen)
        parameters += sum(n for k, n in self._weight_copies.items() if k not in seen)
        seen.update(self._weight_copies)
        gradients = max(self._gradients, _unique_bytes(_grads(model, optimizer), seen))
        breakdown: dict[str, int] = {"parameters": parameters, "gradients": gradients}
        if optimizer is not None:
            breakdown["optimizer_states"] = _unique_bytes(_optimizer_tensors(model, optimizer),
                                                          seen)
        if hooks is not None:
            breakdown["activations"] = self._activations or sum(self._segment.values())
        if self._boundary is not None:
            reserved, named = self._boundary
            breakdown["other"] = max(0, reserved - named - breakdown.get("activations", 0))
        elif self._retained is not None:
            breakdown["other"] = sum(n for k, n in self._retained.items() if k not in seen)
        fields["memb"] = breakdown
        if self._saved:
            self._earlier.append(self._saved)
            del self._earlier[:-RETAINED_SAMPLES]
        self._saved = []
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
                    self._weight_copies[key] = nbytes
                else:
                    self._segment[key] = nbytes
                    self._saved.append((weakref.ref(tensor), key, nbytes))
        return tensor

    def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._in_backward and self._sampling:
            self._in_backward = self._backward_seen = True
            self._activations = max(self._activations, sum(self._segment.values()))
            self._read_boundary(tensor)
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            except RuntimeError:  # unpacked outside a backward pass
                pass
        return tensor

    def _read_boundary(self, tensor: torch.Tensor) -> None:
        """With CUDA, the allocator's reservation and the named parts alive right now."""
        if tensor.device.type != "cuda":
            return
        model = self._model()
        if model is None:
            return
        optimizer = None if self._optimizer is None else self._optimizer()
        seen: set[Key] = set()
        named = _unique_bytes(model.parameters(), seen)
        named += _unique_bytes(_grads(model, optimizer), seen)
        if optimizer is not None:
            named += _unique_bytes(_optimizer_tensors(model, optimizer), seen)
        named += sum(n for k, n in self._weight_copies.items() if k not in seen)
        self._boundary = (torch.cuda.memory_reserved(tensor.device), named)

    def _after_backward(self) -> None:
        model = self._model()
        if model is not None:
            optimizer = None if self._optimizer is None else self._optimizer()
            self._gradients = max(self._gradients,
                                  _unique_bytes(_grads(model, optimizer), set()))

    def _still_alive(self) -> dict[Key, int]:
        alive: dict[Key, int] = {}
        for saved in self._earlier:
            saved[:] = [entry for entry in saved if entry[0]() is not None]
            for _, key, nbytes in saved:
                alive[key] = nbytes
        self._earlier = [saved for saved in self._earlier if saved]
        return alive


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


def _parameters(model: torch.nn.Module,
                optimizer_ref: weakref.ref[torch.optim.Optimizer] | None) -> Iterable[torch.Tensor]:
    yield from model.parameters()
    optimizer = None if optimizer_ref is None else optimizer_ref()
    if optimizer is not None:
        for group in optimizer.param_groups:
            yield from group["params"]


def _grads(model: torch.nn.Module,
           optimizer: torch.optim.Optimizer | None) -> Iterable[torch.Tensor]:
    for p in model.parameters():
        if p.grad is not None:
            yield p.grad
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    yield p.grad


def _optimizer_tensors(model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """Every tensor of the optimizer's state, then the parameters it updates that the model
    does not hold (fp32 master copies)."""
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value
    own = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in own:
                yield p


def _is_weight_copy(tensor: torch.Tensor, params: set[int]) -> bool:
    """Whether ``tensor`` is a cast of a parameter (autocast's low-precision weight copy), or a
    view of one (a matmul saves the transposed cast)."""
    base = tensor._base if tensor._base is not None else tensor
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    for next_fn, _ in fn.next_functions:
        variable = getattr(next_fn, "variable", None)
        if variable is not None and id(variable) in params:
            return True
    return False
