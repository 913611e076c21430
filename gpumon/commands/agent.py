"""`gpumon agent`: the node agent in the foreground until SIGTERM or SIGINT; SIGHUP reloads.

This module's top level imports the standard library only: the command line creates a
``SignalInbox`` from it before anything heavy is imported (see ``SignalInbox``).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any


class SignalInbox:
    """Signals kept for the agent's main loop, which handles them in order.

    SIGHUP (reload) is caught from the first moment: importing the agent takes ~0.3 s, and
    a SIGHUP's default action in that window kills the process. SIGTERM and SIGINT keep
    their default action until the agent has started, so a start that hangs (in a broken
    driver, say) can still be stopped.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self.wake = threading.Event()

    def catch(self, *signums: int) -> None:
        """Keep these signals from now on (main thread only)."""
        for signum in signums:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        self.wake.set()


class AgentCommandError(Exception):
    """The agent could not run; ``exit_code`` 2 for bad configuration, 1 otherwise."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_agent(flags: dict[str, Any], signals: SignalInbox) -> None:
    """Load the configuration, start the agent and serve until a stopping signal."""
    from gpumon.agent import Agent, AgentError
    from gpumon.agent.config import ConfigError, load_config
    from gpumon.export.server import ServeError

    signals.catch(signal.SIGHUP)  # already, when started from the command line
    try:
        cfg = load_config(flags)
    except ConfigError as exc:
        raise AgentCommandError(str(exc), 2) from exc
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The ingest receiver must get the GIL back within a millisecond or two: the kernel
    # queues only a handful of datagrams per Unix socket (net.unix.max_dgram_qlen).
    sys.setswitchinterval(0.001)
    node = Agent(cfg)
    try:
        node.start()
    except (ServeError, AgentError) as exc:
        node.stop()
        raise AgentCommandError(str(exc), 1) from exc
    log = logging.getLogger("gpumon")
    signals.catch(signal.SIGTERM, signal.SIGINT)
    try:
        # No polling: the wait is interrupted by a signal, whose handler sets the event.
        # Signals that came during start-up are handled now, in order.
        while True:
            signals.wake.wait()
            signals.wake.clear()
            while signals.received:
                received = signals.received.pop(0)
                if received != signal.SIGHUP:
                    log.info("received %s, shutting down", signal.Signals(received).name)
                    return
                _reload(node, flags, log)
    finally:
        node.stop()


def _reload(node: Any, flags: dict[str, Any], log: logging.Logger) -> None:
    """SIGHUP: re-read env and config file; a bad new config keeps the running one."""
    from gpumon.agent import AgentError
    from gpumon.agent.config import ConfigError, load_config

    try:
        notes = node.reload(load_config(flags))
    except (ConfigError, AgentError) as exc:
        log.error("reload failed, keeping the running configuration: %s", exc)
        return
    except Exception:  # a reload must never take a running agent down with it
        log.exception("reload failed, keeping the running configuration")
        return
    log.info("configuration reloaded%s", "".join(f"; {n}" for n in notes))
