"""One polling thread for all GPUs, and a thread of its own for a GPU that overruns.

Polled one after another on the collector's thread, a GPU whose every call took 3 s left all
eight GPUs' data ~9 s old while the slow one still looked healthy. A thread per GPU fixed
that but cost eight thread wakeups a cycle, more than the NVML calls themselves. Here one
shared worker thread polls every healthy GPU in turn; the collector asks it at each cycle,
waits up to ``wait_s`` and takes what has answered. A GPU the shared worker is still inside
at that deadline, past its ``budget_s``, is isolated: the worker stuck in it stays with it
alone (its own thread from now on) and a fresh shared worker polls the others, so a hung
GPU delays the others by at most one cycle, once. An isolated GPU whose polls answer within
the budget ``REJOIN_AFTER`` times in a row goes back to the shared worker, and its thread
ends.

A GPU still inside a poll after ``timeout_s`` is reported down with
``error="nvml_timeout"`` until a poll finishes in time again; what its late poll returns is
dropped (it describes a moment long past).

A pollable whose index is negative is not a GPU (NVML's XID events, checked at every round):
it is polled, isolated and rejoined like one, and returns no sample; it is never reported
down.

The agent runs the set as a stream (``cycle``): each worker hands its round's samples on as
soon as the round ends, and what ``sample`` does after its wait (a healthy GPU rejoined, a
hung one reported down) is done at the start of the next cycle instead. The shared round runs
on the agent's clock thread itself, watched by a ``Watchdog`` (a kernel timer: no thread
wakes unless a round overruns); a GPU that overruns there is isolated by the watchdog, and
the clock handed to a fresh thread (``hand_over``). At a 1 s interval each thread woken costs
about what the eight GPUs' NVML calls do: a second of an idle agent wakes one. Without a
``timerfd``, the shared worker keeps a thread of its own and an overrunning GPU is isolated
at the next cycle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpumon.collectors.poll_worker import Pollable, Worker, describe
from gpumon.collectors.samples import GpuSample
from gpumon.collectors.watchdog import Watchdog

log = logging.getLogger(__name__)

TIMEOUT_ERROR = "nvml_timeout"
REJOIN_AFTER = 3
"""Polls in a row within the budget before an isolated GPU goes back to the shared worker."""
MIN_BUDGET_S = 0.05
"""The least time one GPU's poll may take on the shared worker (a real one takes ~1 ms)."""


class PollerSet:
    """The shared worker, the isolated GPUs' workers, and one collection cycle over them."""

    def __init__(self, wait_s: float, timeout_s: float, on_timeout: Callable[[int], None],
                 budget_s: float | None = None) -> None:
        self.wait_s = wait_s
        self.timeout_s = timeout_s
        self.budget_s = budget_s if budget_s is not None else max(0.5 * wait_s, MIN_BUDGET_S)
        self._on_timeout = on_timeout
        self._shared: Worker | None = None
        self._isolated: dict[int, Worker] = {}
        self._timed_out: set[int] = set()
        self._devices: dict[int, Pollable] = {}
        self._generation = 0
        self._lock = threading.Lock()  # what answered, and the timed-out set, in a stream
        self._changing = threading.Lock()  # which worker polls which device
        self._deliver: Callable[[list[GpuSample]], None] | None = None
        self._answered: set[int] = set()
        """GPUs whose samples were handed on since the stream's last cycle."""
        self._watchdog: Watchdog | None = None
        self._inline = False
        """The shared round runs on the stream's caller's thread, watched by ``_watchdog``."""
        self._hand_over: Callable[[], None] | None = None

    def add(self, device: Pollable) -> None:
        """Poll one more device from now on (from any thread: a GPU found later)."""
        with self._changing:
            self._devices[device.index] = device
            if self._shared is None:
                self._shared = self._worker([device], "all")
            else:
                self._shared.add(device)

    def isolated(self) -> list[int]:
        """GPUs polled on a thread of their own (they overran their budget)."""
        return sorted(self._isolated)

    def _worker(self, devices: list[Pollable], what: str) -> Worker:
        self._generation += 1
        worker = Worker(devices, self.timeout_s, self.budget_s,
                        f"gpumon-nvml-{what}-{self._generation}",
                        threaded=not (self._inline and what == "all"))
        if self._deliver is not None:
            worker.on_round = self._handed_on
        return worker

    def sample(self, now: float, monotonic: float) -> list[GpuSample]:
        """Poll every device, wait up to ``wait_s`` for all, return what answered.

        A device with no fresh answer yet is left out of this cycle, or, past ``timeout_s``,
        comes back as down with ``error="nvml_timeout"``.
        """
        workers = self._workers()
        for worker in workers:
            worker.ask(now, monotonic)
        deadline = time.monotonic() + self.wait_s
        for worker in workers:
            worker.wait(deadline - time.monotonic())
        results: dict[int, GpuSample] = {}
        for worker in workers:
            results.update(worker.take())
        with self._changing:
            self._isolate_overrun()
            self._rejoin_healthy()
        self._answering(results)
        samples = list(results.values()) + self._down(set(results), now)
        return sorted(samples, key=lambda s: s.index)

    def cycle(self, now: float, monotonic: float,
              deliver: Callable[[list[GpuSample]], None],
              hand_over: Callable[[], None] | None = None) -> None:
        """One cycle of a stream: the shared round and the isolated GPUs' rounds, each
        worker handing its samples to ``deliver`` as its round ends.

        Given ``hand_over`` (and a kernel with ``timerfd``), the shared round runs here, on
        the caller's thread, and a watchdog armed with the budget watches it: should a poll
        in it overrun, that GPU keeps the round's worker, which takes a thread of its own for
        its later rounds, a fresh worker takes the others, and ``hand_over()`` is called on
        the watchdog's thread, for the caller's schedule to go on elsewhere while this thread
        stays in the hung call. Without ``hand_over``, every round runs on a worker's thread
        and this returns at once; a GPU the shared worker is found inside past its budget at
        the next cycle is isolated then (the GPUs behind it missed that one round, as with
        ``sample``; those before it are handed on now).

        Either way, isolated GPUs answering in time rejoin, and a GPU that has not answered
        since the last cycle, past ``timeout_s``, goes to ``deliver`` as down, on this thread.
        A set is used either through ``sample`` or as a stream, not both.
        """
        if self._deliver is None:
            self._deliver = deliver
            for worker in self._workers():
                worker.on_round = self._handed_on
            if hand_over is not None:
                self._go_inline()
        self._hand_over = hand_over
        with self._changing:
            stuck = self._isolate_overrun()
            self._rejoin_healthy()
        if stuck is not None:  # what its round had before the hang, not left behind it
            self._hand_on_early(stuck)
        with self._lock:
            answered, self._answered = self._answered, set()
        down = self._down(answered, now)
        if down:
            deliver(down)
        with self._changing:
            workers = self._workers()
            shared = self._shared if self._inline else None
        for worker in workers:
            if worker is not shared:
                worker.ask(now, monotonic)
        if shared is not None:
            watchdog = self._watchdog
            assert watchdog is not None
            shared.run_round(now, monotonic, watchdog.arm)
            with self._changing:
                if shared is self._shared:  # else it was isolated, and the watchdog is another's
                    watchdog.disarm()

    def _go_inline(self) -> None:
        """Run the shared round on the stream's thread from now on, where a watchdog can."""
        self._watchdog = Watchdog.create(self.budget_s, self._overran, "gpumon-nvml-watchdog")
        if self._watchdog is None:
            log.info("no timerfd here: the GPUs are polled on a thread of their own")
            return
        with self._changing:
            self._inline = True
            if self._shared is not None:
                self._shared.end_thread()

    def _overran(self) -> None:
        """The watchdog fired: the shared round has run for its budget (on the watchdog's
        thread)."""
        with self._changing:
            shared = self._shared
            if shared is None or shared.idle():
                return  # the round ended as the watchdog fired
            polling = shared.in_poll()
            if polling is None or polling[1] <= self.budget_s:
                # Between two polls (a thread preempted there), or in a later poll than the
                # one the round started with: watch on, a budget from now.
                assert self._watchdog is not None
                self._watchdog.arm()
                return
            stuck = self._isolate_overrun()
            if stuck is None:
                return
            stuck.start_thread()
        self._hand_on_early(stuck)
        hand_over = self._hand_over
        if hand_over is not None:
            hand_over()

    def _hand_on_early(self, stuck: Worker) -> None:
        early = stuck.take()
        if early:
            self._handed_on(early)

    def _handed_on(self, results: dict[int, GpuSample]) -> None:
        """A stream's worker ended a round (on its thread)."""
        self._answering(results)
        with self._lock:
            self._answered.update(results)
        assert self._deliver is not None
        self._deliver(sorted(results.values(), key=lambda s: s.index))

    def _answering(self, results: dict[int, GpuSample]) -> None:
        with self._lock:
            back = self._timed_out.intersection(results)
            self._timed_out -= back
        for index in sorted(back):
            log.warning("GPU %d answers NVML again", index)

    def _down(self, answered: set[int], now: float) -> list[GpuSample]:
        """Down samples of the GPUs that have not answered and are past ``timeout_s`` (or
        were, and have not answered since); ``on_timeout`` for each newly so."""
        down = []
        for index, device in list(self._devices.items()):
            if index in answered or index < 0:
                continue
            with self._lock:
                timed_out = index in self._timed_out
            if timed_out or self._busy_for(device) > self.timeout_s:
                if not timed_out:
                    with self._lock:
                        self._timed_out.add(index)
                    self._on_timeout(index)
                down.append(GpuSample(index=index, t=now, up=False, error=TIMEOUT_ERROR))
        return down

    def _workers(self) -> list[Worker]:
        shared = [self._shared] if self._shared is not None else []
        return shared + list(self._isolated.values())

    def _busy_for(self, device: Pollable) -> float:
        for worker in self._workers():
            polling = worker.in_poll()
            if polling is not None and polling[0] is device:
                return polling[1]
        return 0.0

    def _isolate_overrun(self) -> Worker | None:
        """A device the shared worker is stuck in, past its budget, keeps that worker for
        itself; the others move to a fresh shared worker. Returns the worker isolated."""
        shared = self._shared
        if shared is None:
            return None
        polling = shared.in_poll()
        if polling is None or polling[1] <= self.budget_s:
            return None
        device, busy_s = polling
        others = shared.keep_only(device)
        self._isolated[device.index] = shared
        self._shared = self._worker(others, "all") if others else None
        log.warning("%s: an NVML poll has taken %.2f s (budget %.2f s): polling it on a "
                    "thread of its own so the other GPUs keep their schedule",
                    describe(device), busy_s, self.budget_s)
        return shared

    def _rejoin_healthy(self) -> None:
        """Isolated devices that answered within the budget REJOIN_AFTER times in a row go
        back to the shared worker; their own threads end."""
        for index, worker in list(self._isolated.items()):
            if worker.in_budget_streak < REJOIN_AFTER or not worker.idle():
                continue
            del self._isolated[index]
            device = self._devices[index]
            worker.stop(0.0)
            if self._shared is None:
                self._shared = self._worker([device], "all")
            else:
                self._shared.add(device)
            log.warning("%s answers NVML within its budget again: back on the shared "
                        "polling thread", describe(device))

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Stop every worker; whether all finished (False: one is stuck in the driver)."""
        if self._watchdog is not None:
            self._watchdog.stop()
        deadline = time.monotonic() + timeout_s
        return all([w.stop(max(deadline - time.monotonic(), 0.0)) for w in self._workers()])
