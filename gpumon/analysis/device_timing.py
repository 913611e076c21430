"""Phase shares of a window whose rank times its phases on the GPU on some steps only.

A rank on CUDA times its phases with CUDA events on a sample of steps (the step record's
``device_phases``) and with host clocks on the rest. On the host clock a CUDA phase measures
how long the CPU took to launch its kernels, not how long the GPU ran them: a GPU-bound
``forward`` can show a tiny host time and a long GPU time. Adding the two kinds would let the
many host-timed steps outvote the few GPU-timed ones. So each GPU-timed phase's share of the
step comes from the GPU-timed steps alone (``device_shares``) and is applied to the whole
window's time; a window with none of them takes the shares of the rank's latest window that
had some (the analyzer keeps them). Phases timed on the host everywhere (the data wait) are
summed over every step. A rank that never sent a GPU-timed step (no CUDA, or an older
client) is summed as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpumon.wire import StepRecord

__all__ = ["device_shares", "window_phases"]


def device_shares(steps: Sequence[StepRecord]) -> dict[str, float] | None:
    """Each GPU-timed phase's share of the steps that timed it on the GPU (GPU seconds over
    their durations); ``None`` when no step was GPU-timed."""
    seconds: dict[str, float] = {}
    durations: dict[str, float] = {}
    for s in steps:
        for name in s.device_phases or ():
            seconds[name] = seconds.get(name, 0.0) + s.phases_s.get(name, 0.0)
            durations[name] = durations.get(name, 0.0) + s.duration_s
    if not seconds:
        return None
    return {name: seconds[name] / durations[name] if durations[name] > 0 else 0.0 for name in seconds}


def window_phases(
    steps: Sequence[StepRecord], recent_shares: Mapping[str, float] | None = None
) -> tuple[dict[str, float], tuple[str, ...] | None]:
    """The window's phase seconds and the names that are GPU time (``None``: none are).

    A GPU-timed phase gets its share (from this window's GPU-timed steps, else
    ``recent_shares``) times the steps' total duration; other phases their plain sum.
    """
    shares = device_shares(steps) or recent_shares
    phases: dict[str, float] = {}
    for s in steps:
        for name, seconds in s.phases_s.items():
            if not shares or name not in shares:
                phases[name] = phases.get(name, 0.0) + seconds
    if not shares:
        return phases, None
    total_s = sum(s.duration_s for s in steps)
    for name, share in shares.items():
        phases[name] = share * total_s
    return phases, tuple(shares)
