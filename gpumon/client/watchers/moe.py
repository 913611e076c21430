"""Each MoE layer's expert load, from the routers gpumon recognises, with no code changed.

``watch_experts(monitor, model)`` walks the model's modules once and hooks each router it
recognises through one table, ``ROUTERS``: a row per kind of router (how to tell one, and
what to read of its call), so a new framework is one row. What each row reads is what the
model itself computed for its dispatch, never a recomputation:

- Hugging Face (transformers 5: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...): the experts
  module (``*Experts``, with ``num_experts``) is called with the router's top-k choices,
  ``experts(hidden_states, top_k_index, top_k_weights)``, whatever the router did before
  (softmax top-k, DeepSeek's grouped routing with its bias): its ``top_k_index`` is counted;
- DeepSpeed-MoE: ``TopKGate`` returns ``exp_counts``, the tokens routed to each expert before
  the capacity drops them;
- torchtitan: ``TokenChoiceTopKRouter`` returns ``num_tokens_per_expert``;
- Megatron-core: ``TopKRouter`` returns ``(probs, routing_map)``, a tokens x experts mask.

A layer is named by the numbers of its module's path (``model.layers.3.mlp.experts`` is
``3``), or by its position among the model's MoE layers where those do not tell them apart.
Only forwards with gradients enabled are counted (training, not evaluation under
``no_grad``). A hook never raises into the model: a failure is logged once, and after three
the hook counts nothing more.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumon.client.watchers.expert_load import ExpertLoadWatch
from gpumon.wire import MAX_EXPERTS, MAX_MOE_LAYER_CHARS, is_label

if TYPE_CHECKING:
    from gpumon.client.core.seam import Watched

log = logging.getLogger("gpumon.client")

MAX_HOOK_FAILURES = 3


def expert_watch(monitor: Watched) -> ExpertLoadWatch:
    """The monitor's expert-load extension, attached on first use."""
    return monitor.extensions.attach(ExpertLoadWatch)


def watch_experts(monitor: Watched, model: Any) -> int:
    """Hook every router of ``model`` that ``ROUTERS`` recognises (once per module, however
    often it is called); the number of MoE layers newly hooked."""
    found: list[tuple[str, Any, Router]] = []
    for path, module in model.named_modules():
        for router in ROUTERS:
            if router.matches(module):
                found.append((path, module, router))
                break
    if not found:
        return 0
    watch = expert_watch(monitor)
    hooked = watch.hooked
    names = layer_names([path for path, _, _ in found])
    added = 0
    for (_, module, router), name in zip(found, names, strict=True):
        if id(module) in hooked:
            continue
        hooked.add(id(module))
        router.attach(module, _Counter(watch, name, router.framework))
        added += 1
    if added:
        log.info("gpumon: counting the expert load of %d MoE layer(s) (%s)", added,
                 ", ".join(sorted({router.framework for _, _, router in found})))
    return added


_REFUSED: set[str] = set()  # layers whose bad input was logged already


def count_expert_load(monitor: Watched, layer: object, tokens_per_expert: Any) -> None:
    """``StepMonitor.expert_load``: ``layer``'s tokens per expert, checked, into the watch."""
    name = str(layer) if isinstance(layer, int) and not isinstance(layer, bool) else layer
    try:
        if not (isinstance(name, str) and is_label(name, MAX_MOE_LAYER_CHARS)):
            raise ValueError(f"a MoE layer is an int or 1-{MAX_MOE_LAYER_CHARS} of [A-Za-z0-9_.:/-], "
                             f"not {layer!r}")
        import torch

        counts = tokens_per_expert if isinstance(tokens_per_expert, torch.Tensor) \
            else torch.as_tensor(list(tokens_per_expert), dtype=torch.int64)
        if counts.dim() != 1 or not 0 < counts.numel() <= MAX_EXPERTS or counts.is_floating_point() \
                and counts.device.type == "cpu" and not bool((counts == counts.round()).all()):
            raise ValueError(f"tokens_per_expert must be 1-D, 1-{MAX_EXPERTS} whole counts, "
                             f"not shape {tuple(counts.shape)} of {counts.dtype}")
        if counts.device.type == "cpu" and bool((counts < 0).any()):
            raise ValueError("tokens_per_expert must not be negative")
        expert_watch(monitor).count(name, counts.numel(), counts)
    except Exception as exc:
        key = str(name)[:64]
        if key not in _REFUSED and len(_REFUSED) < 1024:
            _REFUSED.add(key)
            log.warning("gpumon: expert_load(%r) not counted: %s", layer, exc)


def layer_names(paths: list[str]) -> list[str]:
    """Each path's numbers joined by dots (``model.layers.3.mlp.experts`` -> ``3``), or the
    positions ``0, 1, ...`` where that leaves one unnamed, two alike or one too long."""
    names = [".".join(re.findall(r"(?:^|\.)(\d+)(?=\.|$)", path)) for path in paths]
    if len(set(names)) == len(names) and all(is_label(n, MAX_MOE_LAYER_CHARS) for n in names):
        return names
    return [str(index) for index in range(len(paths))]


class _Counter:
    """What a hook calls: counts one layer into the watch, never raising."""

    __slots__ = ("watch", "layer", "framework", "failures")

    def __init__(self, watch: ExpertLoadWatch, layer: str, framework: str) -> None:
        self.watch, self.layer, self.framework, self.failures = watch, layer, framework, 0

    def __call__(self, read: Callable[[], tuple[int, Any, bool]]) -> None:
        if self.failures >= MAX_HOOK_FAILURES:
            return
        try:
            import torch

            if not torch.is_grad_enabled():
                return
            experts, counts, are_indices = read()
            if are_indices:
                self.watch.count_indices(self.layer, experts, counts)
            else:
                self.watch.count(self.layer, experts, counts)
        except Exception:
            self.failures += 1
            if self.failures == 1:
                log.warning("gpumon: could not count the expert load of %s layer %s",
                            self.framework, self.layer, exc_info=True)


# --- the routers -----------------------------------------------------------------------


def _class_is(module_name: str, class_name: str) -> Callable[[Any], bool]:
    def matches(module: Any) -> bool:
        return any(c.__name__ == class_name and c.__module__.startswith(module_name)
                   for c in type(module).__mro__)
    return matches


_TAKES_TOP_K: dict[type, bool] = {}


def _hf_experts(module: Any) -> bool:
    cls = type(module)
    if not (cls.__name__.endswith("Experts") and isinstance(getattr(module, "num_experts", None), int)):
        return False
    takes = _TAKES_TOP_K.get(cls)
    if takes is None:
        try:
            takes = "top_k_index" in inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):
            takes = False
        _TAKES_TOP_K[cls] = takes
    return takes


def _attach_hf(module: Any, counter: _Counter) -> None:
    experts = module.num_experts

    def before(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        indices = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
        counter(lambda: (experts, indices, True))

    module.register_forward_pre_hook(before, with_kwargs=True)


def _attach_output(position: int, experts_of: Callable[[Any, Any], int],
                   counts_of: Callable[[Any], Any]) -> Callable[[Any, _Counter], None]:
    """A router whose output's ``position`` holds its counts (``counts_of`` turns it into
    tokens per expert)."""
    def attach(module: Any, counter: _Counter) -> None:
        def after(_module: Any, _args: Any, output: Any) -> None:
            counter(lambda: (experts_of(module, output[position]), counts_of(output[position]), False))

        module.register_forward_hook(after)
    return attach


def _length(_module: Any, counts: Any) -> int:
    return int(counts.shape[-1])


def _mask_counts(routing_map: Any) -> Any:
    return routing_map.reshape(-1, routing_map.shape[-1]).sum(0)


@dataclass(frozen=True, slots=True)
class Router:
    """A kind of MoE router ``watch_experts`` recognises, and how its counts are read."""

    framework: str
    matches: Callable[[Any], bool]
    attach: Callable[[Any, _Counter], None]
    """Registers the hook that calls the counter with ``(experts, counts, are_indices)``."""


ROUTERS: tuple[Router, ...] = (
    Router("transformers", _hf_experts, _attach_hf),
    Router("deepspeed", _class_is("deepspeed.moe", "TopKGate"),
           _attach_output(-1, _length, lambda counts: counts)),  # exp_counts
    Router("torchtitan", _class_is("torchtitan", "TokenChoiceTopKRouter"),
           _attach_output(2, _length, lambda counts: counts)),  # num_tokens_per_expert
    Router("megatron", _class_is("megatron.core.transformer.moe", "TopKRouter"),
           _attach_output(1, _length, _mask_counts)),  # routing_map
)
"""Every router ``watch_experts`` knows, tried in order: a new one is one row."""
