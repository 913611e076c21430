"""`gpumon agent`: the node agent in the foreground until SIGTERM or SIGINT; SIGHUP reloads.

This module's top level imports the standard library only: the command line creates a
``SignalInbox`` from it before anything heavy is imported (see ``SignalInbox``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any


class SignalInbox:
    """Signals kept for the agent's main loop, which handles them in order.

    SIGHUP (reload) is caught from the first moment: importing the agent takes ~0.3 s, and
    a SIGHUP's default action in that window kills the process. SIGTERM and SIGINT keep
    their default action until the agent has started, so a start that hangs (in a broken
    driver, say) can still be stopped.

    The signals travel through a pipe (``signal.set_wakeup_fd``: the interpreter writes each
    signal's number into it) and the Python handler does nothing. A handler that set a
    ``threading.Event`` could deadlock: it runs on the main thread, which may at that moment
    hold the event's own lock inside ``wait()`` or ``clear()``.
    """

    def __init__(self) -> None:
        self._pipe: tuple[int, int] | None = None

    def catch(self, *signums: int) -> None:
        """Keep these signals from now on (main thread only)."""
        if self._pipe is None:
            self._pipe = os.pipe()
            os.set_blocking(self._pipe[1], False)  # a full pipe must not block the interpreter
            signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        for signum in signums:
            signal.signal(signum, _ignore)

    def wait(self) -> int:
        """The next signal caught, in order of arrival; blocks until there is one."""
        assert self._pipe is not None, "catch() a signal first"
        return os.read(self._pipe[0], 1)[0]


def _ignore(_signum: int, _frame: object) -> None:
    """The wakeup pipe carries the signal; nothing is left to do here."""


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
        # No polling: the main thread sleeps in a read of the signal pipe. Signals that came
        # during start-up are in the pipe already and are handled now, in order.
        while True:
            received = signals.wait()
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
