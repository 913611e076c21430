"""Joining a training step's time window with the GPU samples taken during it.

NVML's utilisation counters are averages over the driver's own sample period (1/6 s to 1 s),
so a step shorter than the sampler's resolution sees zero or one sample. Such steps are
grouped with the steps after them (``group_steps``) and merged (``merge_steps``) before their
window is summarised; the
driver-buffered utilisation samples of ``nvmlDeviceGetSamples`` are simply more ``GpuSample``s
with only ``utilization_ratio`` set, and count like any other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from gpumon.analysis.device_timing import window_phases
from gpumon.collectors.gpu_fields import GPU_FIELDS
from gpumon.collectors.samples import GpuSample
from gpumon.wire import CollectiveOp, CommStats, MemoryStats, StepRecord
from gpumon.wire.frozen import maker

# Fields averaged over a window (the table's ``window`` rows). Memory used is summarised by
# its maximum instead: the highest point in a step is what matters for pressure, not the mean.
MEAN_FIELDS = tuple(f.name for f in GPU_FIELDS if f.window)
_means_of = attrgetter(*MEAN_FIELDS)
"""A sample's ``MEAN_FIELDS``, as a tuple: a window's columns are one ``zip`` of these."""
assert len(MEAN_FIELDS) > 1, "attrgetter of one name gives the value, not a tuple"
_time = attrgetter("t")
# A merged window's records, made by position without a frozen __init__ (``frozen.maker``).
_step_record = maker(StepRecord)
_memory_stats = maker(MemoryStats)
_comm_stats = maker(CommStats)
_collective_op = maker(CollectiveOp)


@dataclass(frozen=True, slots=True)
class GpuWindow:
    """One GPU's activity over a time window: the mean of each field over the samples in it.

    A field is ``None`` when no sample in the window had it; ``counts`` says how many samples
    contributed to each present field (a mean over one sample is weak evidence).
    """

    t0: float
    t1: float
    sample_count: int
    counts: dict[str, int] = field(default_factory=dict)
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_active_ratio: float | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_hz: float | None = None
    nvlink_tx_bytes_per_second: float | None = None
    nvlink_rx_bytes_per_second: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    memory_used_bytes_max: int | None = None
    memory_total_bytes: int | None = None
    clock_event_fractions: dict[str, float] = field(default_factory=dict)
    """Per clock-event reason, the share of samples reporting reasons in which it was active."""

    @property
    def has_gpm(self) -> bool:
        """Whether any GPM metric (SM, tensor or DRAM activity) was sampled in the window."""
        return (
            self.sm_active_ratio is not None
            or self.tensor_active_ratio is not None
            or self.dram_active_ratio is not None
        )


def summarize_gpu_window(samples: Sequence[GpuSample], t0: float, t1: float) -> GpuWindow | None:
    """Summarise one GPU's samples whose timestamps fall in ``[t0, t1]``; ``None`` if there are none.

    Samples of a GPU that was down are skipped. ``samples`` must all be of one GPU, in any
    order: mixing GPUs would average unrelated devices, so it raises ``ValueError``.
    """
    if t1 < t0:
        raise ValueError(f"window ends before it starts: t0={t0!r}, t1={t1!r}")
    indices = {s.index for s in samples}
    if len(indices) > 1:
        raise ValueError(f"samples of several GPUs in one window: {sorted(indices)}")
    inside = [s for s in samples if s.up and t0 <= s.t <= t1]
    if not inside:
        return None

    # Field by field (a column each, the samples' fields read in one call a sample), each
    # summed in the samples' order: the same sums as sample by sample, with a window of a
    # long run's replay holding tens of samples.
    means: dict[str, float] = {}
    counts: dict[str, int] = {}
    columns = zip(*map(_means_of, inside), strict=True)  # every tuple of the same length
    for name, column in zip(MEAN_FIELDS, columns, strict=True):
        total, count = 0.0, 0
        for value in column:
            if value is not None:
                total += float(value)
                count += 1
        if count:
            means[name] = total / count
            counts[name] = count

    used = [s.memory_used_bytes for s in inside if s.memory_used_bytes is not None]
    totals = [s.memory_total_bytes for s in sorted(inside, key=_time)
              if s.memory_total_bytes is not None]
    if used:
        counts["memory_used_bytes"] = len(used)

    reasons_reported = [s.clock_event_reasons for s in inside if s.clock_event_reasons is not None]
    active: dict[str, int] = {}
    for reasons in reasons_reported:
        for reason, on in reasons.items():
            active[reason] = active.get(reason, 0) + (1 if on else 0)
    fractions = {reason: n / len(reasons_reported) for reason, n in active.items()}

    return GpuWindow(
        t0=t0,
        t1=t1,
        sample_count=len(inside),
        counts=counts,
        memory_used_bytes_max=max(used) if used else None,
        memory_total_bytes=totals[-1] if totals else None,
        clock_event_fractions=fractions,
        **{name: means.get(name) for name in MEAN_FIELDS},
    )


def merge_steps(steps: Sequence[StepRecord],
                device_shares: Mapping[str, float] | None = None) -> StepRecord:
    """One record standing for consecutive steps of one rank, e.g. to widen a short window.

    The merged step spans from the first start to the last end (when starts are known), its
    phases are summed (GPU-timed phases of a rank on CUDA: see ``device_timing``), and counts
    (samples, tokens, flops) are summed only when every step has them, since a partial sum
    would understate throughput. Allocator counters are cumulative, so the last step's are
    kept; the peak is the highest peak. Measured communication is summed over the steps that
    carry it (a step without it had none measured, not none).
    ``device_shares``: the rank's latest GPU-timed phase shares, for a window without
    GPU-timed steps of its own.
    """
    if not steps:
        raise ValueError("merge_steps needs at least one step")
    if len(steps) == 1 and (steps[0].device_phases or not device_shares):
        return steps[0]
    first, last = steps[0], steps[-1]
    run, rank = first.run, first.rank
    for s in steps:
        if s.run != run or s.rank != rank:
            raise ValueError("merge_steps needs steps of one run and rank")

    busy_s = sum(s.duration_s for s in steps)
    starts = [s.t_start for s in steps]
    t_start: float | None = None
    duration_s = busy_s
    if all(t is not None for t in starts):
        t_start = min(t for t in starts if t is not None)
        t_end = max(s.t_start + s.duration_s for s in steps if s.t_start is not None)
        # Gaps between steps (work outside the hook) count as unattributed time.
        duration_s = max(busy_s, t_end - t_start)

    phases, device_phases = window_phases(steps, device_shares)

    # StepRecord(run=..., ...), by position and without the frozen __init__ (a window each)
    return _step_record(
        run, rank, last.step, duration_s, last.world, last.local_rank, t_start, phases,
        _sum_if_all([s.samples for s in steps]), _sum_if_all([s.tokens for s in steps]),
        _sum_if_all_float([s.flops for s in steps]), last.gpu, last.pid,
        _merge_mem([s.mem for s in steps]), _merge_comm([s.comm for s in steps]),
        None, device_phases, None, None)


def group_steps(steps: Sequence[StepRecord], min_window_s: float) -> list[list[StepRecord]]:
    """Consecutive steps of one rank, in groups that each span ``min_window_s``.

    A group closes once it spans ``min_window_s`` (see ``span_s``); a skipped step number
    closes it early (a lost record would otherwise be counted as idle time). The last group may
    be shorter than ``min_window_s``: a streaming caller holds it back until more steps arrive.
    """
    groups: list[list[StepRecord]] = []
    current: list[StepRecord] = []
    for step in steps:
        if current:
            previous = current[-1]
            if step.step != previous.step + 1:
                groups.append(current)
                current = []
            else:
                start, end = current[0].t_start, previous.t_end  # span_s(current), inline
                span = end - start if start is not None and end is not None \
                    else sum(s.duration_s for s in current)
                if span >= min_window_s:
                    groups.append(current)
                    current = []
        current.append(step)
    if current:
        groups.append(current)
    return groups


def span_s(steps: Sequence[StepRecord]) -> float:
    """Seconds from the first step's start to the last one's end (the sum of their durations
    when a start is unknown)."""
    first, last = steps[0], steps[-1]
    if first.t_start is None or last.t_end is None:
        return sum(s.duration_s for s in steps)
    return last.t_end - first.t_start


def _sum_if_all(values: Sequence[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if len(present) == len(values) else None


def _sum_if_all_float(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if len(present) == len(values) else None


def _merge_mem(stats: Sequence[MemoryStats | None]) -> MemoryStats | None:
    present = [m for m in stats if m is not None]
    if not present:
        return None
    last = present[-1]
    peaks = [m.peak_bytes for m in present if m.peak_bytes is not None]
    return _memory_stats(last.allocated_bytes, last.reserved_bytes,
                         max(peaks) if peaks else None, last.alloc_retries, last.ooms)


def _merge_comm(stats: Sequence[CommStats | None]) -> CommStats | None:
    """Measured communication of consecutive steps: times, counts and bytes summed, per op."""
    present = [c for c in stats if c is not None]
    if not present:
        return None
    ops: dict[str, tuple[int, int, float]] = {}
    for comm in present:
        for op in comm.ops:
            count, size, seconds = ops.get(op.name, (0, 0, 0.0))
            ops[op.name] = (count + op.count, size + op.bytes, seconds + op.seconds)
    bubbles = [c.bubble_s for c in present if c.bubble_s is not None]
    return _comm_stats(sum(c.exposed_s for c in present), sum(c.busy_s for c in present),
                       tuple(_collective_op(name, *figures) for name, figures in ops.items()),
                       sum(bubbles) if bubbles else None)
