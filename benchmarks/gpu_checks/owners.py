"""Whose the training process is, as the agent exports it: ``gpumon_rank_info``'s owner labels
for the hook's rank, and the ``gpumon_gpu_owner_info`` series of the GPU this process holds
(NVML lists a CUDA process; the dry run's fake NVML lists other pids, so that part is
informational there). The process's own cgroup text and what the parser reads from it are
brought back, so each node shows the layout it really has."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from gpumon.collectors.cgroup import parse_cgroup
from gpumon.collectors.process_owner import user_name
from gpumon.testing import AgentProcess, parse_metrics, series

from .hook import RUN
from .report import Report

WAIT_S = 15.0  # the agent works out owners every 5 s


def section_owners(report: Report, result: dict[str, Any], agent: AgentProcess,
                   device: str) -> None:
    """The hook's rank and this process's GPU carry this process's owner."""
    pid, user = str(os.getpid()), user_name(os.getuid())
    cgroup = Path("/proc/self/cgroup").read_text()
    result["cgroup"] = cgroup.splitlines()[:12]
    result["cgroup_place"] = parse_cgroup(cgroup)
    deadline, ranks, holders = time.monotonic() + WAIT_S, [], []
    text = ""
    while time.monotonic() < deadline:
        text = agent.scrape(10.0)
        samples = parse_metrics(text)
        ranks = [labels for labels, _ in series(samples, "gpumon_rank_info", run=RUN)]
        holders = [labels for labels, _ in series(samples, "gpumon_gpu_owner_info", pid=pid)]
        if any(r.get("user") for r in ranks) and (holders or device != "cuda"):
            break
        time.sleep(1.0)
    (report.out / "metrics_owners.txt").write_text(text)
    result["rank_info"] = ranks
    result["gpu_owner_info"] = holders
    result["gpu_owner_series"] = sum(1 for line in text.splitlines()
                                     if line.startswith("gpumon_gpu_owner_info{"))
    report.check("owners.rank_names_node_and_user",
                 bool(ranks) and all(r.get("node") and r.get("user") == user for r in ranks),
                 {"expected_user": user, "rank_info": ranks})
    report.check("owners.gpu_holder_is_this_process",
                 (bool(holders) and all(h.get("run") == RUN and h.get("user") == user
                                        for h in holders)) if device == "cuda" else None,
                 {"pid": pid, "gpu_owner_info": holders})
