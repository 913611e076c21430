"""OOM risk on a real device: memory held in growing chunks up to ~85 % of the device (never
more) with steps running and /metrics polled for gpumon_oom_risk_ratio / _predicted_seconds;
then freed, with steps going on, so the series shows whether the risk comes back down; then a
*raised* (not allocated) torch.OutOfMemoryError through the hook's step."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from gpumon.testing import AgentProcess, first, parse_metrics

from .report import GIB, Report, SkipSection, gib, jsonable
from .workload import Workload

OOM_RUN = "gpu-node-check-oom"
MAX_MEMORY_SHARE = 0.85  # never hold more than this share of device memory (NVML's count)


def section_oom(report: Report, result: dict[str, Any], torch: Any, agent: AgentProcess,
                device: str) -> None:
    """Hold device memory in growing chunks (at most ~85 % of NVML's total), steps running.

    Without CUDA (dry run) nothing is allocated: the steps report the memory they would hold
    (``StepMonitor.step(memory=...)``, against the fake H200's capacity), which exercises the
    loop, the agent's OOM analysis, the polling and the report; its checks are informational.
    """
    from gpumon.client import StepMonitor

    cuda = device == "cuda"
    work = Workload(torch, "mlp", device)
    mon = StepMonitor(OOM_RUN, socket_path=str(agent.socket_path))
    if cuda:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used_now = total - free
        budget = int(MAX_MEMORY_SHARE * total) - used_now - 1 * GIB
        if budget < 4 * GIB:
            raise SkipSection(f"only {budget / GIB:.1f} GiB could be held under "
                              f"{MAX_MEMORY_SHARE:.0%}")
    else:
        total, used_now = 150754820096, GIB  # the dry run's fake H200
        budget = int(MAX_MEMORY_SHARE * total) - used_now - 1 * GIB
    result["memory"] = {"total": total, "used_before": used_now, "to_hold": budget,
                        "max_share": MAX_MEMORY_SHARE}
    chunks, grow_s, hold_s, after_s = 16, 8.0, 4.0, 8.0
    if report.quick:
        chunks, grow_s, hold_s, after_s = 6, 3.0, 1.0, 3.0
    chunk = budget // chunks
    held: list[Any] = []
    series: list[dict[str, Any]] = []
    best: dict[str, Any] = {"risk": -1.0, "text": ""}
    stop = threading.Event()
    t0_unix = time.time()

    def poll() -> None:
        while not stop.wait(1.0):
            try:
                text = agent.scrape(10.0)
            except Exception as exc:
                series.append({"error": repr(exc)})
                continue
            m = parse_metrics(text)
            risk = first(m, "gpumon_oom_risk_ratio", run=OOM_RUN)
            series.append({
                "t": round(time.time() - t0_unix, 1), "held_gib": round(len(held) * chunk / GIB, 2),
                "risk": risk,
                "predicted_s": first(m, "gpumon_oom_predicted_seconds", run=OOM_RUN),
                "headroom_gib": gib(first(m, "gpumon_oom_headroom_bytes", run=OOM_RUN)),
                "nvml_used_gib": gib(first(m, "gpumon_gpu_memory_used_bytes", gpu="0")),
                "torch_reserved_gib": gib(first(m, "gpumon_torch_memory_reserved_bytes",
                                                run=OOM_RUN)),
            })
            if risk is not None and risk > best["risk"]:
                best.update(risk=risk, text=text)

    poller = threading.Thread(target=poll, name="oom-poll", daemon=True)
    poller.start()
    try:
        start = time.perf_counter()
        while time.perf_counter() - start < grow_s + hold_s:
            elapsed = time.perf_counter() - start
            if len(held) < chunks and elapsed >= len(held) * grow_s / chunks:
                held.append(torch.empty(chunk, dtype=torch.uint8, device=device) if cuda else None)
            pretend = None if cuda else {"allocated": len(held) * chunk,
                                         "reserved": len(held) * chunk, "peak": len(held) * chunk}
            work.train(2, mon, pretend)
            time.sleep(0.005)  # ~200 steps/s at most: the recording stays small
        work.sync()
        result["held_max_bytes"] = len(held) * chunk
        held.clear()
        if cuda:
            torch.cuda.empty_cache()
        start = time.perf_counter()
        while time.perf_counter() - start < after_s:
            work.train(2, mon, None if cuda else {"allocated": 0, "reserved": 0, "peak": 0})
            time.sleep(0.005)
        work.sync()
        mon.flush()
        time.sleep(2.5)
    finally:
        held.clear()
        if cuda:
            torch.cuda.empty_cache()
        stop.set()
        poller.join(timeout=5)
        mon.close()
    if best["text"]:
        (report.out / "metrics_oom.txt").write_text(best["text"])
    result["series"] = series
    risks = [p["risk"] for p in series if p.get("risk") is not None]
    predicted = [p["predicted_s"] for p in series if p.get("predicted_s") is not None]
    report.check("oom.risk_rises_under_pressure", (bool(risks) and max(risks) >= 0.4) if cuda else None,
                 {"max_risk": max(risks) if risks else None, "last_risk": risks[-1] if risks else None,
                  "max_held_gib": round(result.get("held_max_bytes", 0) / GIB, 2)})
    report.check("oom.predicted_seconds_while_growing", bool(predicted) if cuda else None,
                 {"values": predicted[:12]})
    report.check("oom.risk_falls_after_free", (bool(risks) and risks[-1] < max(risks)) if cuda else None,
                 {"last": risks[-1] if risks else None})


def section_oom_event(report: Report, result: dict[str, Any], torch: Any, agent: AgentProcess) -> None:
    """A raised (not allocated) torch.OutOfMemoryError through the hook's step: the oom event
    reaches the agent and counts in gpumon_torch_ooms_total. Needs no CUDA."""
    from gpumon.client import StepMonitor

    run = OOM_RUN + "-event"
    mon = StepMonitor(run, socket_path=str(agent.socket_path))
    with mon.step():
        pass  # one ordinary step first, so the rank exists with its counters
    mon.flush()
    time.sleep(1.5)
    before = first(parse_metrics(agent.scrape(10.0)), "gpumon_torch_ooms_total", run=run)
    with contextlib.suppress(torch.OutOfMemoryError):
        with mon.step():
            raise torch.OutOfMemoryError("gpu_node_check: simulated, no allocation was made")
    mon.flush()
    time.sleep(1.5)
    after = first(parse_metrics(agent.scrape(10.0)), "gpumon_torch_ooms_total", run=run)
    result.update(before=before, after=after, client_stats=jsonable(mon.stats))
    report.check("oom.event_counted", after is not None and after >= (before or 0) + 1,
                 {"before": before, "after": after})
    mon.close()



def markdown(d: dict[str, Any]) -> list[str]:
    """The OOM-risk series, one row per poll."""
    lines: list[str] = []
    oom = d["sections"].get("oom", {})
    if oom.get("series"):
        lines += ["", "## OOM-risk series", "", "| t | held GiB | risk | predicted s | headroom GiB "
                  "| NVML used GiB | torch reserved GiB |", "|---|---|---|---|---|---|---|"]
        for p in oom["series"]:
            lines.append(f"| {p.get('t')} | {p.get('held_gib')} | {p.get('risk')} | "
                         f"{p.get('predicted_s')} | {p.get('headroom_gib')} | {p.get('nvml_used_gib')} "
                         f"| {p.get('torch_reserved_gib')} |")
    return lines
