"""A GPU whose NVML calls hang, on the fake library: isolated on its own thread while the others
keep their schedule (the clock's thread, stuck in the call, hands the schedule over), then back
on the shared round once its calls answer in time again."""

from __future__ import annotations

import threading
from pathlib import Path

from gpumon.testing.fakenvml import Scenario
from tests.helpers import agent_env, start_agent, value, wait_for


def test_a_hung_gpu_is_isolated_and_rejoins_when_healthy(tmp_path: Path,
                                                         fake_nvml_lib: Path) -> None:
    path = tmp_path / "one_hangs.scn"
    path.write_text("gpu_count 4\ngpu 0 hang nvmlDeviceGetPowerUsage 3.0\n")
    agent = start_agent(tmp_path, "--interval", "0.25",
                        env=agent_env(fake_nvml_lib.parent, path))
    try:
        wait_for(lambda: value(agent.metrics(), "gpumon_gpu_up", gpu="0") == 0,
                 timeout=30, what="GPU 0 marked down")
        assert "polling it on a thread of its own" in agent.log()
        # It hung on the clock's thread, which handed the agent's schedule to a fresh one.
        assert agent.log().count("is stuck in a call; its other cycles go on") == 1
        _, snap = agent.json("/api/v1/snapshot")
        fresh = {g["index"]: snap["t"] - g["t"] for g in snap["gpus"] if g["up"]}
        assert sorted(fresh) == [1, 2, 3] and max(fresh.values()) < 1.0, fresh

        scenario = Scenario.load(path)
        scenario.gpu(0).hangs.clear()  # the driver recovers
        scenario.dump(path)

        def rejoined() -> bool:
            m = agent.metrics()
            return all(value(m, "gpumon_gpu_up", gpu=str(i)) == 1 for i in range(4)) \
                and "back on the shared polling thread" in agent.log()

        wait_for(rejoined, timeout=30, what="GPU 0 back on the shared thread")
        status, body = agent.json("/readyz")
        assert not any("NVML in time" in p for p in body["problems"]), body
        threading.Event().wait(1.5)  # six more cycles: it stays on the shared thread
        assert agent.log().count("polling it on a thread of its own") == 1
        assert [value(agent.metrics(), "gpumon_gpu_up", gpu=str(i)) for i in range(4)] == [1] * 4
    finally:
        assert agent.stop() == 0, agent.log()
