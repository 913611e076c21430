"""The step extension that counts each MoE layer's tokens per expert and sends the window's
summary with each step (the wire's ``moe``, docs/moe.md).

Counting never synchronises the GPU. Each layer's counts are added, on the device the router
ran on, into an accumulator of the layer's own (``index_add_``: no kernel that reads a size
back, as ``bincount`` on CUDA does). At the step's end the accumulators of a CUDA device are
concatenated and copied ``non_blocking`` into pinned host memory, a CUDA event is recorded
after the copy, and the accumulators are zeroed on the stream: the training thread queues
three kernels and goes on. The step's record carries a ``Deferred`` the sender thread resolves
once the GPU has passed the event (as it does for GPU-timed phases), reading the host copy
then and updating the window there, in step order. On the CPU the accumulators are read at
the step's end directly (the counts are there already), and the window is updated on the
sender's thread too.
"""

from __future__ import annotations

import logging
from typing import Any

from gpumon.client.watchers.expert_window import ExpertWindow

log = logging.getLogger("gpumon.client")


class ExpertCounts:
    """One step's counts, as the sender thread will read them (a ``Deferred``)."""

    __slots__ = ("_window", "_layers", "_host", "_event")

    def __init__(self, window: ExpertWindow, layers: list[tuple[str, int]], host: Any,
                 event: Any = None) -> None:
        self._window = window
        self._layers = layers  # (name, experts) in the order of the host copy
        self._host = host  # a list of ints (CPU) or a pinned tensor the GPU is copying into
        self._event = event

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def value(self) -> object | None:
        host = self._host if isinstance(self._host, list) else self._host.tolist()
        counts, start = {}, 0
        for name, experts in self._layers:
            counts[name] = host[start:start + experts]
            start += experts
        return self._window.add(counts)

    def abandon(self) -> None:
        self._host = None


class ExpertLoadWatch:
    """The monitor's MoE layers: ``count(layer, experts, tokens_per_expert)`` adds a layer's
    routing to the open step; ``step_end`` hands the step's counts to the sender."""

    def __init__(self) -> None:
        self.window = ExpertWindow()
        self._layers: dict[str, tuple[int, Any]] = {}  # name -> (experts, accumulator)
        self._order: list[str] = []
        self.counted = False  # anything counted since the last step's end
        self.hooked: set[int] = set()  # ids of the router modules hooked (moe.watch_experts)

    def step_begin(self) -> None:
        pass

    def count(self, layer: str, experts: int, tokens_per_expert: Any) -> None:
        """Add ``tokens_per_expert`` (a tensor of ``experts`` counts, on any device) to
        ``layer``'s accumulator, on that device, queued and never waited for."""
        import torch

        entry = self._layers.get(layer)
        if entry is None or entry[1].device != tokens_per_expert.device:
            if entry is not None:
                self._order.remove(layer)
            accumulator = torch.zeros(experts, dtype=torch.int64, device=tokens_per_expert.device)
            entry = self._layers[layer] = (experts, accumulator)
            self._order.append(layer)
        elif entry[0] != experts:
            raise ValueError(f"MoE layer {layer!r} had {entry[0]} experts, now {experts}")
        entry[1].add_(tokens_per_expert.to(torch.int64))
        self.counted = True

    def count_indices(self, layer: str, experts: int, indices: Any) -> None:
        """Add the experts chosen for each token (``indices``, any shape, one expert per
        entry; an entry outside ``0..experts-1`` marks a token sent nowhere and is not
        counted) to ``layer``'s accumulator."""
        import torch

        flat = indices.reshape(-1)
        if flat.device.type == "cpu":  # one kernel, and nothing to wait for on the host
            try:
                self.count(layer, experts, torch.bincount(flat, minlength=experts + 1)[:experts])
                return
            except RuntimeError:  # a negative entry: the general path below
                pass
        flat = flat.to(torch.int64)
        valid = (flat >= 0) & (flat < experts)
        slots = torch.where(valid, flat, torch.full_like(flat, experts))
        counts = torch.zeros(experts + 1, dtype=torch.int64, device=flat.device)
        counts.index_add_(0, slots, torch.ones_like(slots))
        self.count(layer, experts, counts[:experts])

    def step_end(self, fields: dict[str, object]) -> None:
        if not self.counted:
            return
        self.counted = False
        cpu = [name for name in self._order if self._layers[name][1].device.type != "cuda"]
        if len(cpu) == len(self._order):
            host: list[int] = []
            layers = []
            for name in cpu:
                experts, accumulator = self._layers[name]
                host.extend(accumulator.tolist())
                accumulator.zero_()
                layers.append((name, experts))
            fields["moe"] = ExpertCounts(self.window, layers, host)
            return
        fields["moe"] = self._copy_from_device()

    def _copy_from_device(self) -> ExpertCounts:
        """The accumulators of the first CUDA device, copied without a wait. Layers on another
        device (a model split over GPUs, a layer left on the CPU) are zeroed and left out: one
        record carries one copy, and one event says when it has landed."""
        import torch

        entries = [(name, *self._layers[name]) for name in self._order]
        device = next(acc.device for _, _, acc in entries if acc.device.type == "cuda")
        here = [(name, experts, acc) for name, experts, acc in entries if acc.device == device]
        flat = torch.cat([acc for _, _, acc in here])
        host = torch.empty(flat.numel(), dtype=torch.int64, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        torch._foreach_zero_([acc for _, _, acc in entries])
        return ExpertCounts(self.window, [(name, experts) for name, experts, _ in here], host, event)
