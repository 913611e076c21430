"""Verdicts and OOM risk exported by a live agent fed with synthetic steps over its socket."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest

from gpumon.agent.lifecycle import Agent
from gpumon.sim.gpus import Activity
from tests.helpers import (
    parse_metrics,
    require_tool,
    scrape_text,
    value,
    values,
    wait_for,
)

GIB = 1024**3


pytestmark = pytest.mark.agent(library=True, simulate=2, interval=0.2)


def send(agent: Agent, records: list[dict]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(json.dumps(records).encode(), agent.config.socket)


scrape = scrape_text


def test_input_bound_steps_get_an_input_verdict(agent: Agent) -> None:
    uuid = agent.state.gpu_statics()[0].uuid
    source = agent._gpu_source
    source.set_activity(0, Activity(utilization=0.3, sm_active=0.25, tensor_active=0.15,
                                    dram_active=0.1, memory_used_bytes=20 * GIB))
    start = time.time()
    for n in range(12):  # 0.25 s steps, 60 % of each waiting for data, sent as they end
        t0 = start + n * 0.25
        send(agent, [{"v": 1, "kind": "step", "run": "job", "rank": 0, "step": n,
                      "t_start": t0, "duration": 0.25, "gpu": uuid,
                      "phases": {"data": 0.15, "forward": 0.04, "backward": 0.05,
                                 "optimizer": 0.01}}])
        time.sleep(max(0.0, t0 + 0.25 - time.time()))
    m = wait_for(lambda: (lambda m: values(m, "gpumon_step_bottleneck_total", bottleneck="input")
                          and value(m, "gpumon_step_bottleneck_total", bottleneck="input") >= 8
                          and m)(parse_metrics(scrape(agent))),
                 what="input verdicts")
    assert value(m, "gpumon_step_bottleneck_current", run="job", rank="0", bottleneck="input") == 1
    assert value(m, "gpumon_step_bottleneck_current", run="job", rank="0", bottleneck="compute") == 0
    assert value(m, "gpumon_step_bottleneck_total", bottleneck="compute") == 0
    assert 0 < value(m, "gpumon_step_bottleneck_confidence", run="job", rank="0") <= 1


def test_growing_peaks_predict_oom_before_capacity(agent: Agent) -> None:
    static = agent.state.gpu_statics()[0]
    capacity = static.memory_total_bytes
    start = time.time()
    sent_peak = 0
    predicted: list[float] = []
    risk: list[float] = []
    for n in range(40):  # peaks grow 1 GiB per 0.1 s step from 40 GiB: 80 GiB at step 40
        t0 = start + n * 0.1
        sent_peak = (40 + n) * GIB
        send(agent, [{"v": 1, "kind": "step", "run": "leak", "rank": 0, "step": n,
                      "t_start": t0, "duration": 0.1, "gpu": static.uuid,
                      "phases": {"forward": 0.04, "backward": 0.05},
                      "mem": {"allocated": sent_peak - GIB, "reserved": sent_peak,
                              "peak": sent_peak, "retries": 0, "ooms": 0}}])
        time.sleep(max(0.0, t0 + 0.1 - time.time()))
        m = parse_metrics(scrape(agent))
        predicted = values(m, "gpumon_oom_predicted_seconds", run="leak", rank="0")
        risk = values(m, "gpumon_oom_risk_ratio", run="leak", rank="0")
        if predicted and risk and risk[0] >= 0.8:
            break
    assert predicted, "no OOM prediction before capacity"
    assert sent_peak < capacity  # warned while there was still room
    assert risk[0] >= 0.8
    # 1 GiB per 0.1 s: the remaining headroom is gone in a few seconds.
    assert 0 < predicted[0] < 10


def test_scrape_with_verdicts_passes_promtool(agent: Agent) -> None:
    promtool = require_tool("promtool")
    send(agent, [{"v": 1, "kind": "step", "run": "p", "rank": 0, "step": 0,
                  "t_start": time.time() - 2, "duration": 1.0}])
    wait_for(lambda: "gpumon_step_bottleneck_total{" in scrape(agent))
    result = subprocess.run([promtool, "check", "metrics"], input=scrape(agent),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rank_info_carries_the_resolved_device_uuid(agent: Agent) -> None:
    uuid = agent.state.gpu_statics()[1].uuid
    send(agent, [{"v": 1, "kind": "step", "run": "idx", "rank": 0, "step": 0,
                  "t_start": time.time() - 3, "duration": 1.0, "gpu": 1}])  # a CUDA index
    m = wait_for(lambda: (lambda m: values(m, "gpumon_rank_info", run="idx", gpu=uuid) and m)(
        parse_metrics(scrape(agent))), what="rank attributed to GPU 1's UUID")
    assert value(m, "gpumon_rank_info", run="idx", rank="0", gpu=uuid) == 1
