"""One polling thread for all GPUs; a GPU whose poll overruns gets a thread of its own and
comes back when healthy. Devices here block on events the test controls (no NVML)."""

from __future__ import annotations

import threading

from gpumon.collectors.pollers import REJOIN_AFTER, TIMEOUT_ERROR, PollerSet
from gpumon.collectors.samples import GpuSample
from tests.helpers import wait_for


class Device:
    """A GPU whose poll blocks while ``free`` is clear, and answers at once when set."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.free = threading.Event()
        self.free.set()
        self.polls = 0
        self.threads: set[str] = set()
        self.last_thread = ""

    def sample(self, now: float, monotonic: float) -> GpuSample:
        self.free.wait()
        self.polls += 1
        self.last_thread = threading.current_thread().name
        self.threads.add(self.last_thread)
        return GpuSample(index=self.index, t=now, power_watts=100.0 + self.index)


def poller_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("gpumon-nvml-")}


def test_one_thread_polls_every_gpu_until_one_hangs_then_it_is_isolated_and_comes_back() -> None:
    timeouts: list[int] = []
    pollers = PollerSet(wait_s=1.0, timeout_s=2.0, on_timeout=timeouts.append, budget_s=0.05)
    devices = [Device(i) for i in range(8)]
    before = poller_threads()
    for device in devices:
        pollers.add(device)
    try:
        for cycle in range(3):
            samples = pollers.sample(float(cycle), float(cycle))
            assert [s.index for s in samples] == list(range(8))
            assert all(s.up for s in samples)
        assert len(poller_threads() - before) == 1  # one thread for eight GPUs
        assert len({name for d in devices for name in d.threads}) == 1

        devices[2].free.clear()  # GPU 2's driver calls stop returning
        samples = pollers.sample(3.0, 3.0)
        # The cycle it hung in: GPUs 0 and 1 answered; 3-7 were behind it on the thread.
        assert [s.index for s in samples] == [0, 1]
        assert pollers.isolated() == [2]
        for cycle in range(4, 10):  # from the next cycle on, the others are never delayed
            samples = {s.index: s for s in pollers.sample(float(cycle), float(cycle))}
            assert all(samples[i].up and samples[i].t == cycle for i in range(8) if i != 2)
            if 2 in samples:  # left out until its timeout, then down
                assert samples[2].error == TIMEOUT_ERROR
        assert timeouts == [2]
        assert len(poller_threads() - before) == 2  # the shared one and GPU 2's own

        devices[2].free.set()  # healthy again: its late answer is dropped, then it rejoins
        cycle = 10
        while pollers.isolated() and cycle < 10 + REJOIN_AFTER + 5:
            samples = pollers.sample(float(cycle), float(cycle))
            cycle += 1
        assert pollers.isolated() == []
        samples = pollers.sample(float(cycle), float(cycle))
        assert [s.index for s in samples] == list(range(8)) and all(s.up for s in samples)
        # Back on the shared thread with the others; its own thread has ended.
        assert len({d.last_thread for d in devices}) == 1
        assert len(devices[2].threads) == 2
        wait_for(lambda: len(poller_threads() - before) == 1, timeout=5,
                 what="the isolated thread to end")
    finally:
        for device in devices:
            device.free.set()
        assert pollers.stop(2.0)
