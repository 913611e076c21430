"""A plain wrapper: turn a train-step function into a monitored one."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from gpumon.client.monitor import StepMonitor

F = TypeVar("F", bound=Callable[..., Any])
Count = int | float | Callable[..., Any] | None


def wrap_step(
    monitor: StepMonitor,
    fn: F,
    *,
    samples: Count = None,
    tokens: Count = None,
    flops: Count = None,
) -> F:
    """Return ``fn`` run inside ``monitor.step()`` on every call.

    Args:
        monitor: the monitor reporting the steps.
        fn: the function doing one training step.
        samples, tokens, flops: a number for every step, or a function called with ``fn``'s
            arguments that returns the step's number (e.g. ``samples=lambda batch: len(batch)``).
    """

    @functools.wraps(fn)
    def monitored(*args: Any, **kwargs: Any) -> Any:
        with monitor.step(
            samples=_value(samples, args, kwargs),
            tokens=_value(tokens, args, kwargs),
            flops=_value(flops, args, kwargs),
        ):
            return fn(*args, **kwargs)

    return monitored  # type: ignore[return-value]


def _value(count: Count, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return count(*args, **kwargs) if callable(count) else count
