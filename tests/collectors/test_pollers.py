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


def eight_gpus(timeout_s: float) -> tuple[PollerSet, list[Device], list[int]]:
    """Eight devices on a set, and the GPUs it reports timed out."""
    timeouts: list[int] = []
    pollers = PollerSet(wait_s=1.0, timeout_s=timeout_s, on_timeout=timeouts.append,
                        budget_s=0.05)
    devices = [Device(i) for i in range(8)]
    for device in devices:
        pollers.add(device)
    return pollers, devices, timeouts


def test_one_thread_polls_every_gpu_until_one_hangs_then_it_is_isolated_and_comes_back() -> None:
    before = poller_threads()
    pollers, devices, timeouts = eight_gpus(timeout_s=2.0)
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


DOWN = GpuSample(index=-1, t=0.0, up=False)


class Stream:
    """What a stream handed on, and on which threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.samples: list[GpuSample] = []
        self.threads: set[str] = set()

    def deliver(self, samples: list[GpuSample]) -> None:
        with self._lock:
            self.samples.extend(samples)
            self.threads.add(threading.current_thread().name)

    def of_cycle(self, t: float) -> dict[int, GpuSample]:
        with self._lock:
            return {s.index: s for s in self.samples if s.t == t}


def test_a_stream_hands_samples_on_from_its_worker_and_isolates_a_hung_gpu_a_cycle_later() -> None:
    pollers, devices, timeouts = eight_gpus(timeout_s=0.5)
    stream = Stream()
    try:
        devices[0].free.clear()
        pollers.cycle(0.0, 0.0, stream.deliver)  # returns with GPU 0's poll still held
        assert stream.samples == []
        devices[0].free.set()
        wait_for(lambda: len(stream.of_cycle(0.0)) == 8, timeout=5, what="the first round")
        # Handed on by the worker that polled, not by the thread that asked.
        assert stream.threads == {devices[0].last_thread}
        assert threading.current_thread().name not in stream.threads

        devices[2].free.clear()  # GPU 2's driver calls stop returning
        pollers.cycle(1.0, 1.0, stream.deliver)
        wait_for(lambda: devices[2].threads and pollers._shared is not None
                 and (pollers._shared.in_poll() or (None, 0.0))[1] > 0.05,
                 timeout=5, what="the worker to be stuck in GPU 2 past its budget")
        assert stream.of_cycle(1.0) == {}  # the round has not ended: nothing handed on yet
        pollers.cycle(2.0, 2.0, stream.deliver)
        assert pollers.isolated() == [2]
        # What the hung round had (GPUs 0 and 1) came out at once; 3-7 were behind GPU 2.
        assert sorted(stream.of_cycle(1.0)) == [0, 1]
        wait_for(lambda: sorted(stream.of_cycle(2.0)) == [0, 1, 3, 4, 5, 6, 7], timeout=5,
                 what="the others polled by a fresh worker in the next cycle")
        wait_for(lambda: pollers._busy_for(devices[2]) > 0.5, timeout=5,
                 what="GPU 2 past its timeout")
        pollers.cycle(3.0, 3.0, stream.deliver)
        assert stream.of_cycle(3.0)[2].error == TIMEOUT_ERROR  # on the asking thread, at once
        assert timeouts == [2]

        devices[2].free.set()  # its late answer is dropped; then it answers and rejoins
        wait_for(lambda: pollers._isolated[2].idle(), timeout=5, what="the late round's end")
        cycle = 4.0
        while pollers.isolated() and cycle < 4 + REJOIN_AFTER + 5:
            pollers.cycle(cycle, cycle, stream.deliver)
            wait_for(lambda c=cycle: stream.of_cycle(c).get(2, DOWN).up, timeout=5,
                     what="GPU 2's answer")
            cycle += 1
        assert pollers.isolated() == []
        assert stream.of_cycle(cycle - 1)[2].up
        assert all(s.up for s in stream.samples if s.t == 1.0)  # the late answer was dropped
        pollers.cycle(cycle, cycle, stream.deliver)
        wait_for(lambda: len(stream.of_cycle(cycle)) == 8, timeout=5, what="all eight again")
        assert len({d.last_thread for d in devices}) == 1
    finally:
        for device in devices:
            device.free.set()
        assert pollers.stop(2.0)


class Check(Device):
    """A pollable that is not a GPU (as the XID events' check): it returns no sample."""

    def __init__(self) -> None:
        super().__init__(-1)

    def sample(self, now: float, monotonic: float) -> None:  # type: ignore[override]
        super().sample(now, monotonic)
        return None


def test_a_check_that_is_not_a_gpu_rides_the_round_and_when_it_hangs_is_isolated_not_down() -> None:
    pollers, devices, timeouts = eight_gpus(timeout_s=0.5)
    check = Check()
    pollers.add(check)
    stream = Stream()
    try:
        pollers.cycle(0.0, 0.0, stream.deliver)
        wait_for(lambda: len(stream.of_cycle(0.0)) == 8, timeout=5, what="the first round")
        assert check.polls == 1 and check.last_thread == devices[0].last_thread  # same round
        assert -1 not in stream.of_cycle(0.0)

        check.free.clear()  # the check stops returning: it is polled first, the GPUs wait
        pollers.cycle(1.0, 1.0, stream.deliver)
        wait_for(lambda: (pollers._shared.in_poll() or (None, 0.0))[1] > 0.05  # type: ignore[union-attr]
                 and check.threads, timeout=5, what="the worker to be stuck in the check")
        pollers.cycle(2.0, 2.0, stream.deliver)
        assert pollers.isolated() == [-1]
        wait_for(lambda: len(stream.of_cycle(2.0)) == 8, timeout=5,
                 what="the GPUs polled by a fresh worker")
        wait_for(lambda: pollers._busy_for(check) > 0.5, timeout=5, what="the check past timeout")
        pollers.cycle(3.0, 3.0, stream.deliver)
        wait_for(lambda: len(stream.of_cycle(3.0)) == 8, timeout=5, what="the GPUs again")
        assert timeouts == [] and all(s.up for s in stream.samples)  # never reported down
        assert all(s.index >= 0 for s in stream.samples)
    finally:
        check.free.set()
        for device in devices:
            device.free.set()
        assert pollers.stop(2.0)


def test_an_inline_stream_polls_on_the_callers_thread_and_a_watchdog_hands_a_hang_over() -> None:
    """Given ``hand_over``, the shared round runs on the thread that asks; when GPU 2 hangs
    there, the watchdog (no thread woken until then) isolates it within about its budget
    and hands the caller's schedule over; the caller's next cycle, on another thread, polls
    the others at once."""
    pollers, devices, timeouts = eight_gpus(timeout_s=0.5)
    stream = Stream()
    handed: list[str] = []
    resumed = threading.Event()

    def hand_over() -> None:
        handed.append(threading.current_thread().name)
        resumed.set()

    def cycle(t: float) -> None:
        pollers.cycle(t, t, stream.deliver, hand_over)

    try:
        before = poller_threads()
        cycle(0.0)  # returns with every sample handed on, from this thread
        assert sorted(stream.of_cycle(0.0)) == list(range(8))
        assert stream.threads == {threading.current_thread().name}
        assert not [t for t in poller_threads() - before if t.startswith("gpumon-nvml-all")]

        devices[2].free.clear()  # GPU 2's driver calls stop returning
        stuck = threading.Thread(target=cycle, args=(1.0,), name="the-first-clock")
        stuck.start()
        assert resumed.wait(5), "no hand-over"
        assert handed == ["gpumon-nvml-watchdog"] and pollers.isolated() == [2]
        assert sorted(stream.of_cycle(1.0)) == [0, 1]  # what the hung round had
        assert stuck.is_alive()  # still inside GPU 2's call
        cycle(2.0)  # the schedule goes on here: the others at once
        assert sorted(stream.of_cycle(2.0)) == [0, 1, 3, 4, 5, 6, 7]
        wait_for(lambda: pollers._busy_for(devices[2]) > 0.5, timeout=5,
                 what="GPU 2 past its timeout")
        cycle(3.0)
        assert stream.of_cycle(3.0)[2].error == TIMEOUT_ERROR
        assert timeouts == [2]

        devices[2].free.set()  # the hung call returns: the first clock's thread ends
        stuck.join(5)
        assert not stuck.is_alive()
        cycle_t = 4.0
        while pollers.isolated() and cycle_t < 4 + REJOIN_AFTER + 5:
            cycle(cycle_t)
            wait_for(lambda c=cycle_t: stream.of_cycle(c).get(2, DOWN).up, timeout=5,
                     what="GPU 2's answer")
            cycle_t += 1
        assert pollers.isolated() == []
        cycle(cycle_t)
        assert sorted(stream.of_cycle(cycle_t)) == list(range(8))
        assert devices[2].last_thread == threading.current_thread().name  # back inline
        assert handed == ["gpumon-nvml-watchdog"]
    finally:
        for device in devices:
            device.free.set()
        assert pollers.stop(2.0)


class Slow(Device):
    """A GPU whose poll takes ``delay_s`` (a driver call that answers, slowly)."""

    def __init__(self, index: int, delay_s: float) -> None:
        super().__init__(index)
        self.delay_s = delay_s

    def sample(self, now: float, monotonic: float) -> GpuSample:
        threading.Event().wait(self.delay_s)
        return super().sample(now, monotonic)


def test_an_inline_round_longer_than_the_budget_is_not_a_hang_when_each_poll_is_within_it() -> None:
    """Four polls of 0.6 budgets each: the watchdog fires inside the round, finds each poll
    within its budget, and watches on; nothing is isolated or handed over."""
    pollers = PollerSet(wait_s=1.0, timeout_s=5.0, on_timeout=lambda index: None, budget_s=0.1)
    for index in range(4):
        pollers.add(Slow(index, 0.06))
    stream, handed = Stream(), []
    try:
        for t in (0.0, 1.0):
            pollers.cycle(t, t, stream.deliver, lambda c=t: handed.append(c))
            assert sorted(stream.of_cycle(t)) == [0, 1, 2, 3]
        assert handed == [] and pollers.isolated() == []
    finally:
        assert pollers.stop(2.0)
