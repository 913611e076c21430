"""``gpumon_gpu_owner_info``: one series per (GPU, holding process), saying whose it is.

A join series (``... * on (uuid) group_left(pod, namespace) gpumon_gpu_owner_info``) rather than
owner labels on every GPU series: a GPU's series count stays what it is however many jobs
share the node, and a holder that comes and goes adds or removes one series.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.core import Metric

from gpumon.collectors.samples import OWNER_LABELS, GpuStatic, Owner
from gpumon.export.exposition import GaugeFamily
from gpumon.state.owners import Ownership

RankKey = tuple[str, int]


def owner_families(ownership: Ownership, gpus: Iterable[GpuStatic],
                   processes: Mapping[int, Iterable[int]],
                   ranks: Mapping[int, RankKey]) -> Iterator[Metric]:
    """The holders of each GPU (``processes``: GPU index -> the pids NVML lists on it) with
    their owners, and the run and rank each sends steps for (``ranks``: by kernel pid)."""
    info = GaugeFamily(
        "gpumon_gpu_owner_info",
        "1 for each process holding a GPU (NVML's process list), or where none is listed, the "
        "container the kubelet allocated it to (pid empty); whose it is, as the agent verified "
        "it, and the run and rank it reports steps for (empty when none).",
        labels=["gpu", "uuid", "pid", "run", "rank", *OWNER_LABELS])
    for gpu in gpus:
        allocated = ownership.allocated.get(gpu.uuid)
        listed = sorted(set(processes.get(gpu.index, ())))
        for pid in listed:
            owner = ownership.by_pid.get(pid) or allocated or Owner(node=ownership.node)
            run, rank = ranks.get(pid, ("", ""))
            info.add_metric([str(gpu.index), gpu.uuid, str(pid), run, str(rank),
                             *owner.labels()], 1.0)
        if not listed and allocated is not None:
            info.add_metric([str(gpu.index), gpu.uuid, "", "", "", *allocated.labels()], 1.0)
    yield info
