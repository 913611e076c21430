"""The ``nvml`` collector: the agent's GPU source (NVML, or the simulator standing in for it)
polled every interval, GPUs that appear later looked for, and the source's XID events taken
with each poll."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumon.agent.collectors.base import CollectorAgent
    from gpumon.agent.scheduler import Periodic
    from gpumon.collectors.base import GpuSource
    from gpumon.collectors.samples import GpuSample

log = logging.getLogger(__name__)

DISCOVER_EVERY_CYCLES = 30  # look for GPUs that appeared after start (30 s at 1 s polls)


def start(agent: CollectorAgent) -> None:
    """Poll the agent's GPU source every interval on the agent's clock (the source polls on
    threads of its own, its XID events with its GPUs), when the agent has one."""
    source = agent.gpu_source
    if source is None:
        return
    poll = GpuPoll(agent, source)
    poll.cycle = agent.run_every(source.name, agent.config.interval, poll.poll,
                                 finishes_later=True)
    source.watch_xids(agent.state.add_xid)


class GpuPoll:
    """The GPU collector's cycle, with when it last looked for new GPUs. The source hands the
    samples on as its polls end (``GpuSource.poll``): the cycle is timed, and its success
    marked, when they arrive."""

    def __init__(self, agent: CollectorAgent, source: GpuSource) -> None:
        self._agent = agent
        self._source = source
        self._discovered_at = time.monotonic()
        self._stats = agent.state.collector(source.name, agent.config.interval)
        self._started = (0.0, 0.0)  # (now, monotonic) of the cycle under way
        self._discovering: threading.Thread | None = None
        self.cycle: Periodic | None = None
        """Its cycle on the agent's clock, handed over to a fresh thread should a poll hang."""

    def poll(self, now: float, monotonic: float) -> None:
        """Ask every GPU for a sample (into the node state and the recording as they come);
        every ``DISCOVER_EVERY_CYCLES`` intervals, a look for GPUs that appeared."""
        if monotonic - self._discovered_at >= DISCOVER_EVERY_CYCLES * self._agent.config.interval \
                and not (self._discovering and self._discovering.is_alive()):
            self._discovered_at = monotonic
            self._discovering = threading.Thread(target=self._discover, daemon=True,
                                                 name="gpumon-nvml-discover")
            self._discovering.start()
        self._started = (now, monotonic)
        cycle = self.cycle
        self._source.poll(now, monotonic, self.deliver,
                          None if cycle is None else cycle.hand_over)

    def _discover(self) -> None:
        """Look for GPUs that appeared, on a thread of its own: NVML's count and opening a GPU
        may hang where a GPU fell off the bus, and the clock runs the agent's other cycles."""
        agent, source = self._agent, self._source
        try:
            new = source.discover()
        except Exception:  # a source's own errors are counted by it; keep the agent going
            log.exception("looking for new GPUs failed")
            return
        if new:
            log.info("new GPU(s) found: %s", ", ".join(f"{g.index} ({g.uuid})" for g in new))
            agent.state.set_nvml(agent.state.nvml, source.statics())

    def deliver(self, samples: list[GpuSample]) -> None:
        """Samples of this cycle (all, or one worker's) into the node state and the
        recording; the cycle took until its latest delivery."""
        agent = self._agent
        agent.state.put_gpu_samples(samples)
        recorder = agent.recorder
        if recorder is not None:
            recorder.gpus(samples, agent.state.gpu_statics())
        started_t, started = self._started
        self._stats.last_duration_s = time.monotonic() - started
        self._stats.last_success_t = started_t
