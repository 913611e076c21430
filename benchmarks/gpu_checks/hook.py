"""The hook on a real training loop: an agent, a transformer trained through ``StepMonitor``
(data, forward, backward, optimizer), /metrics scraped while it runs and after. Checks that the
steps arrived, verdicts exist, events are recorded through the CUDA runtime (not torch's
GIL-releasing ``Event.record``) on a sample of steps, their phase times add up to the step
time, torch memory metrics are there, the rank is attributed to the NVML GPU and the GPU looked
busy; then blocks of steps with and without the hook, alternated (median ratio of hooked to
bare throughput, against its target), for the GPU-bound transformer and a launch-bound small
MLP, and each beside a thread running Python (hook calls holding the loop over 1 ms)."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from gpumon.testing import AgentProcess, Metrics, first, parse_metrics, quantile, series

from .agent import cpu_seconds, get_text
from .cuda_path import cuda_call_costs, hook_stalls
from .report import Report, jsonable, now, tb
from .workload import Workload

RUN = "gpu-node-check"


def read_recording(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of the agent's recording so far (a torn last line is skipped)."""
    lines = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                lines.append(json.loads(line))
    return lines


def section_training(report: Report, result: dict[str, Any], torch: Any, agent: AgentProcess,
                     device: str) -> Any:
    """Train through the hook against the agent; returns (workload, monitor) for the next
    sections."""
    from gpumon.analysis.devices import resolve_peak_flops
    from gpumon.client import StepMonitor

    work = Workload(torch, "transformer", device)
    result["model"] = {"kind": "transformer", "params": work.params, "tokens_per_step": work.tokens,
                       "flops_per_step": work.flops, "device": device}
    work.train(10)  # warm-up, bare (cuBLAS handles, allocator)
    work.sync()
    mon = StepMonitor(RUN, socket_path=str(agent.socket_path))
    result["monitor"] = {"cuda_clock": mon._cuda is not None, "gpu": mon.gpu,
                         "rank": mon.rank, "world": mon.world}
    report.check("hook.cuda_event_timing_active", (mon._cuda is not None) if device == "cuda" else None,
                 {"cuda_clock": mon._cuda is not None, "reported_gpu": mon.gpu})
    runtime = getattr(mon._cuda, "runtime", None)
    report.check("hook.native_cuda_events", (runtime is not None) if device == "cuda" else None,
                 {"runtime": repr(runtime),
                  "device_interval_s": getattr(mon._cuda, "device_interval_s", None)})

    min_steps, min_s, max_s = (300, 10.0, 40.0) if device == "cuda" else (60, 6.0, 20.0)
    if report.quick:
        min_steps, min_s, max_s = 20, 2.0, 8.0
    mid: dict[str, Any] = {}
    stop_mid = threading.Event()

    def mid_training_scrape() -> None:
        if stop_mid.wait(min_s * 0.6):
            return
        try:
            text = agent.scrape(10.0)
            (report.out / "metrics_mid_training.txt").write_text(text)
            mid["samples"] = parse_metrics(text)
            mid["t"] = time.time()
        except Exception:
            mid["error"] = tb()

    scraper = threading.Thread(target=mid_training_scrape, name="mid-scrape", daemon=True)
    agent_cpu0, wall0, t_start = cpu_seconds(agent), time.perf_counter(), time.time()
    scraper.start()
    steps = 0
    while (steps < min_steps or time.perf_counter() - wall0 < min_s) and \
            time.perf_counter() - wall0 < max_s and steps < 20000:
        work.train(10, mon)
        steps += 10
    work.sync()
    wall = time.perf_counter() - wall0
    t_end = time.time()
    stop_mid.set()
    scraper.join(timeout=15)
    agent_cpu1 = cpu_seconds(agent)
    mon.flush()
    result["training"] = {"steps": steps, "wall_s": wall, "steps_per_s": steps / wall,
                          "t_start": t_start, "t_end": t_end}
    if agent_cpu0 is not None and agent_cpu1 is not None:
        result["agent_cpu_ratio_during_training"] = (agent_cpu1 - agent_cpu0) / wall
    if device == "cuda":
        result["torch_memory_end"] = {"allocated": torch.cuda.memory_allocated(),
                                      "reserved": torch.cuda.memory_reserved(),
                                      "max_allocated": torch.cuda.max_memory_allocated()}
    # Wait for every record, then for a verdict.
    deadline = now() + 15
    text = ""
    samples: Metrics = {}
    while now() < deadline:
        text = agent.scrape(10.0)
        samples = parse_metrics(text)
        got = first(samples, "gpumon_steps_total", run=RUN) or 0
        verdicts = series(samples, "gpumon_step_bottleneck_current", run=RUN)
        if got >= steps and verdicts and now() > deadline - 12:  # >= 3 s after the last step
            break
        time.sleep(0.5)
    (report.out / "metrics_after_training.txt").write_text(text)
    code, body = get_text(agent.url + "/api/v1/snapshot", 10)
    snapshot = json.loads(body) if code == 200 else {"status": code, "body": body[:500]}
    result["snapshot"] = snapshot
    stats = mon.stats
    result["client_stats"] = jsonable(stats)

    # Checks -------------------------------------------------------------------------------
    got = first(samples, "gpumon_steps_total", run=RUN)
    report.check("agent.steps_arrived", got == steps,
                 {"agent_steps_total": got, "steps_run": steps, "client_sent": stats.records_sent,
                  "client_dropped": stats.dropped,
                  "agent_dropped": {lab.get("reason"): v for lab, v in
                                    series(samples, "gpumon_ingest_dropped_total") if v}})
    current = {lab["bottleneck"]: v for lab, v in series(samples, "gpumon_step_bottleneck_current", run=RUN)}
    totals = {lab["bottleneck"]: v for lab, v in
              series(samples, "gpumon_step_bottleneck_total", run=RUN)}
    confidence = first(samples, "gpumon_step_bottleneck_confidence", run=RUN)
    report.check("agent.verdict_metrics", bool(current) and sum(current.values()) == 1
                 and confidence is not None,
                 {"current": [k for k, v in current.items() if v == 1], "confidence": confidence,
                  "steps_by_bottleneck": {k: v for k, v in totals.items() if v}})
    flags = {lab.get("flag"): v for lab, v in series(samples, "gpumon_step_flag", run=RUN)}
    ranks = snapshot.get("ranks", []) if isinstance(snapshot, dict) else []
    mine = next((r for r in ranks if r.get("run") == RUN), {})
    report.check("agent.verdict_detail", None, {"flags": flags, "analysis": mine.get("analysis")})
    # Phases: per-step sums from the recording (CUDA-event times + host data time) vs duration.
    recording = read_recording(report.out / "recording.jsonl")
    step_lines = [r for r in recording if r.get("kind") == "step" and r.get("run") == RUN]
    # On CUDA only the GPU-timed steps (those with "dev") carry GPU seconds; the rest are host
    # clocks, whose CUDA phases measure launches.
    gpu_timed = [r for r in step_lines if r.get("dev")]
    durations = [r["duration"] for r in step_lines if r.get("duration")]
    expected = sum(durations) / max(0.1, statistics.median(durations)) if durations else 0
    report.check("hook.sampled_gpu_timing",
                 (0 < len(gpu_timed) <= len(step_lines)) if device == "cuda" else None,
                 {"steps_gpu_timed": len(gpu_timed), "steps_recorded": len(step_lines),
                  "gpu_timed_at_most_about": round(expected) + 1,
                  "dev_phases": sorted({p for r in gpu_timed for p in r["dev"]})})
    ratios, missing = [], 0
    for r in (gpu_timed if device == "cuda" and gpu_timed else step_lines):
        phases = r.get("phases") or {}
        if not {"forward", "backward", "optimizer"} <= set(phases):
            missing += 1
            continue
        if r.get("duration"):
            ratios.append(sum(phases.values()) / r["duration"])
    phase_totals = {lab["phase"]: v for lab, v in
                    series(samples, "gpumon_step_phase_seconds_total", run=RUN)}
    duration_sum = first(samples, "gpumon_step_duration_seconds_sum", run=RUN)
    aggregate = (sum(phase_totals.values()) / duration_sum) if duration_sum else None
    median_ratio = statistics.median(ratios) if ratios else None
    report.check("hook.phase_sum_vs_step_time",
                 median_ratio is not None and 0.7 <= median_ratio <= 1.15 and missing == 0,
                 {"median_ratio": median_ratio, "p10": quantile(ratios, 0.1) if ratios else None,
                  "p90": quantile(ratios, 0.9) if ratios else None, "aggregate_ratio": aggregate,
                  "steps_missing_phases": missing, "steps_recorded": len(step_lines),
                  "steps_compared": len(ratios),
                  "phase_seconds_total": phase_totals, "duration_seconds_sum": duration_sum,
                  "wall_s": wall})
    mem = {name: first(samples, f"gpumon_torch_memory_{name}_bytes", run=RUN)
           for name in ("allocated", "reserved", "peak")}
    report.check("hook.torch_memory_metrics",
                 all(v is not None and v > 0 for v in mem.values()) if device == "cuda" else None,
                 {**mem, "torch_end": result.get("torch_memory_end")})
    # The rank's GPU: the UUID torch reports must be NVML's.
    gpu_info = series(samples, "gpumon_gpu_info")
    nvml_uuids = sorted(lab.get("uuid", "") for lab, _ in gpu_info)
    rank_gpu = [lab.get("gpu") for lab, _ in series(samples, "gpumon_rank_info", run=RUN)]
    report.check("agent.rank_attributed_to_nvml_gpu",
                 bool(rank_gpu) and rank_gpu[0] in nvml_uuids if device == "cuda" else None,
                 {"rank_info_gpu": rank_gpu, "nvml_uuids": nvml_uuids,
                  "client_reported": mon.gpu, "analysis_gpu_index": (mine.get("analysis") or {}).get("gpu")})
    # GPU busy while training: the recording's GPU samples in the training window, and the
    # gauges of the mid-training scrape.
    window = [r for r in recording if r.get("kind") == "gpu" and t_start + 1 <= r.get("t", 0) <= t_end]
    busy: dict[str, Any] = {"samples_in_window": len(window)}
    for key in ("utilization", "memory_utilization", "sm_active", "sm_occupancy", "tensor_active",
                "dram_active", "power_watts", "pcie_tx_bytes_per_second", "nvlink_tx_bytes_per_second"):
        vals = [r[key] for r in window if isinstance(r.get(key), (int, float))]
        if vals:
            busy[key] = {"median": statistics.median(vals), "max": max(vals)}
    mid_samples = mid.get("samples") or {}
    busy["mid_scrape"] = {name: first(mid_samples, name, gpu="0") for name in (
        "gpumon_gpu_utilization_ratio", "gpumon_gpu_sm_active_ratio",
        "gpumon_gpu_tensor_active_ratio", "gpumon_gpu_dram_active_ratio",
        "gpumon_gpu_power_watts", "gpumon_gpu_sm_clock_hertz", "gpumon_gpu_memory_used_bytes")}
    if mid.get("error"):
        busy["mid_scrape_error"] = mid["error"]
    util_max = (busy.get("utilization") or {}).get("max")
    report.check("agent.gpu_busy_during_training",
                 util_max is not None and util_max > 0.3 if device == "cuda" else None, busy)
    # MFU against our own arithmetic.
    name = snapshot.get("gpus", [{}])[0].get("model") if isinstance(snapshot, dict) and \
        snapshot.get("gpus") else None
    peak = resolve_peak_flops(name, None) if name else None
    own_mfu = (work.flops * steps / wall / peak) if peak else None
    report.check("agent.mfu", None, {"gpumon_step_mfu_ratio": first(samples, "gpumon_step_mfu_ratio",
                                                                     run=RUN),
                                     "own_estimate": own_mfu, "peak_flops_used": peak,
                                     "device_name": name})
    pid = str(os.getpid())
    report.check("agent.process_memory_by_pid",
                 bool(series(samples, "gpumon_gpu_process_memory_bytes", pid=pid))
                 if device == "cuda" else None,
                 {"pids_seen": [lab.get("pid") for lab, _ in
                                series(samples, "gpumon_gpu_process_memory_bytes")], "our_pid": pid})
    report.check("agent.process_cpu_metrics",
                 first(samples, "gpumon_process_cpu_seconds_total", run=RUN) is not None,
                 first(samples, "gpumon_process_cpu_seconds_total", run=RUN))
    errors = {f"{lab.get('collector')}:{lab.get('error')}": v
              for lab, v in series(samples, "gpumon_collector_errors_total") if v}
    report.check("agent.no_collector_errors", not errors, errors)
    durations = {lab.get("collector"): v for lab, v in
                 series(samples, "gpumon_collector_duration_seconds")}
    report.check("agent.collector_durations", None, durations)
    report.check("agent.cpu_during_training", None, result.get("agent_cpu_ratio_during_training"))
    return work, mon



def section_overhead(report: Report, result: dict[str, Any], torch: Any, device: str,
                     work: Workload | None, mon: Any) -> None:
    """Alternating blocks with and without the hook on the same model and monitor."""
    cuda = device == "cuda"
    if cuda and mon._cuda is not None:
        result["cuda_calls_us"] = costs = cuda_call_costs(torch, mon._cuda.runtime)
        report.check("overhead.cuda_calls", None, costs)
    plans = [("transformer", work, 15 if cuda else 4, 50 if cuda else 10),
             ("mlp", None, 15 if cuda else 4, 50 if cuda else 20)]
    if report.quick:
        plans = [(name, w, 2, 4) for name, w, _, _ in plans]
    for name, existing, pairs, block in plans:
        if report.remaining() < 40:
            result[name] = "skipped: out of time"
            continue
        w = existing or Workload(torch, name, device)
        w.train(5, mon)
        w.train(5)
        w.sync()
        ratios, hooked_s, bare_s = [], [], []
        for k in range(pairs):
            if report.remaining() < 30:
                break
            times = {}
            order = ("bare", "hooked") if k % 2 == 0 else ("hooked", "bare")
            for kind in order:
                w.sync()
                t0 = time.perf_counter()
                if kind == "hooked":
                    w.train(block, mon)
                    w.sync()
                    mon.flush()  # everything the sender does for these steps, billed here
                else:
                    w.train(block)
                    w.sync()
                times[kind] = time.perf_counter() - t0
            ratios.append(times["bare"] / times["hooked"])  # hooked/bare throughput
            hooked_s.append(times["hooked"] / block)
            bare_s.append(times["bare"] / block)
        if not ratios:
            result[name] = "skipped: out of time"
            continue
        per_step_cost = [h - b for h, b in zip(hooked_s, bare_s, strict=True)]
        result[name] = {
            "pairs": len(ratios), "block_steps": block, "params": w.params,
            "median_throughput_ratio_hooked_to_bare": statistics.median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios),
            "median_bare_step_s": statistics.median(bare_s),
            "median_hooked_step_s": statistics.median(hooked_s),
            "median_extra_s_per_step": statistics.median(per_step_cost),
            "ratios": [round(r, 4) for r in ratios],
        }
        target = OVERHEAD_TARGETS[name]
        result[name]["target"] = target
        report.check(f"overhead.{name}",
                     result[name]["median_throughput_ratio_hooked_to_bare"] >= target if cuda else None,
                     {k: v for k, v in result[name].items() if k != "ratios"})
        if report.remaining() >= 30:
            result[f"{name}_busy_thread"] = stalls = hook_stalls(w, mon, 40 if report.quick else 400)
            report.check(f"overhead.{name}_busy_thread_stalls", None, stalls)


OVERHEAD_TARGETS = {"mlp": 0.995, "transformer": 0.999}
"""Hooked ÷ bare throughput each model must reach on a GPU: the launch-bound MLP's ~2 ms
step leaves the hook 10 µs; the GPU-bound transformer hides the hook behind its kernels."""

def markdown(d: dict[str, Any]) -> list[str]:
    """The overhead blocks' medians."""
    lines: list[str] = []
    over = d["sections"].get("overhead", {})
    if over:
        lines += ["", "## Hook overhead (throughput hooked / bare, median of pairs; targets "
                  + ", ".join(f"{k} ≥ {v}" for k, v in OVERHEAD_TARGETS.items()) + ")", ""]
        for name in ("transformer", "mlp"):
            o = over.get(name)
            if isinstance(o, dict):
                lines.append(f"- {name}: {o['median_throughput_ratio_hooked_to_bare']:.4f} "
                             f"(min {o['min_ratio']:.4f}, max {o['max_ratio']:.4f}; "
                             f"{o['pairs']} pairs of {o['block_steps']} steps; bare step "
                             f"{o['median_bare_step_s'] * 1e3:.3f} ms, extra per step "
                             f"{o['median_extra_s_per_step'] * 1e6:.1f} µs)")
            busy = over.get(f"{name}_busy_thread")
            if isinstance(busy, dict):
                for variant, b in busy.items():
                    lines.append(f"  - beside a busy Python thread, {variant}: {b['calls_over_1ms']} "
                                 f"hook calls over 1 ms in {b['steps']} steps (max {b['max_call_ms']} ms)")
        if isinstance(over.get("cuda_calls_us"), dict):
            for call, us in over["cuda_calls_us"].items():
                lines.append(f"- {call}: {us} µs per call")
    return lines
