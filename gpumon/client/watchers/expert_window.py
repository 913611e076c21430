"""Each MoE layer's expert load over the rank's last steps, summarised for the wire.

The tokens each expert received travel nowhere: 64 experts x 32 layers of counts would not fit
a datagram, and the agent exports one series per layer, never per expert. The client keeps
each layer's counts over its last ``MOE_WINDOW_STEPS`` steps and sends what the alerts read:
the busiest expert's tokens over the mean (1 when balanced: the ranks holding it compute while
the others wait in the all-to-all), the coefficient of variation, and the experts that got no
token in the whole window (they stop learning). One step's counts are too few to tell a
router's skew from the batch's noise; a window of steps is what a router's aux loss and
capacity act on.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

from gpumon.wire import MAX_EXPERTS, MAX_MOE_LAYERS

MOE_WINDOW_STEPS = 50
"""Steps each summary covers (docs/moe.md): the last 50 steps a rank counted."""


def summarise(counts: Sequence[int]) -> list[int | float] | None:
    """``[experts, tokens, max_ratio, cv, dead]`` of one layer's counts per expert, the wire's
    shape (ratio and CV rounded to 6 digits), or ``None`` when no token was routed."""
    experts = len(counts)
    tokens = sum(counts)
    if tokens <= 0 or not 0 < experts <= MAX_EXPERTS:
        return None
    mean = tokens / experts
    variance = sum((c - mean) ** 2 for c in counts) / experts
    dead = sum(1 for c in counts if c == 0)
    return [experts, int(tokens), round(max(counts) / mean, 6), round(math.sqrt(variance) / mean, 6), dead]


class ExpertWindow:
    """The counts of each layer over the last ``steps`` steps a rank reported (a layer not
    counted in a step counts nothing there). ``add`` runs once per step, in step order."""

    def __init__(self, steps: int = MOE_WINDOW_STEPS) -> None:
        self.steps = steps
        self._history: deque[Mapping[str, Sequence[int]]] = deque()
        self._totals: dict[str, list[int]] = {}
        self.refused = 0
        """Counts left out: a layer whose number of experts changed, or one layer too many."""

    def add(self, step_counts: Mapping[str, Sequence[int]]) -> dict[str, object] | None:
        """Count one step's tokens per expert of each layer; the wire's ``moe`` field over the
        window that ends with it, or ``None`` while no layer has routed a token."""
        kept: dict[str, Sequence[int]] = {}
        totals = self._totals
        for layer, counts in step_counts.items():
            total = totals.get(layer)
            if total is None:
                if len(totals) >= MAX_MOE_LAYERS or not 0 < len(counts) <= MAX_EXPERTS:
                    self.refused += 1
                    continue
                total = totals[layer] = [0] * len(counts)
            elif len(total) != len(counts):
                self.refused += 1
                continue
            for index, count in enumerate(counts):
                total[index] += count
            kept[layer] = counts
        history = self._history
        history.append(kept)
        while len(history) > self.steps:
            for layer, counts in history.popleft().items():
                total = totals[layer]
                for index, count in enumerate(counts):
                    total[index] -= count
        layers = {}
        for layer, total in totals.items():
            summary = summarise(total)
            if summary is not None:
                layers[layer] = summary
        if not layers:
            return None
        return {"window": min(len(history), self.steps), "layers": layers}
