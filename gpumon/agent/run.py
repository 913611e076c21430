"""`gpumon agent`: the node agent in the foreground until SIGTERM or SIGINT; SIGHUP reloads.

The command line parses the flags, then replaces its process (``os.execv``: the same pid,
so a supervisor's signals reach the agent) with ``python -m gpumon.agent``, which gets the
flags as JSON and imports only what the agent needs: the command line's parser and what it
brings (typer, click, pydantic, rich: ~12 MiB) would otherwise stay in a daemon that never
parses again.

This module's top level imports the standard library only: the command line creates a
``SignalInbox`` from it before anything heavy is imported (see ``SignalInbox``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Any

from gpumon.errors import GpumonError

SIGNAL_FDS_FLAG = "--signal-fds="


class SignalInbox:
    """SIGTERM, SIGINT and SIGHUP for the agent's main loop, which handles them in order.

    Caught from the first moment: importing the agent takes ~0.3 s, and in that window a
    SIGHUP's default action killed the process, and a SIGTERM right after the agent answered
    its first /readyz left a stale socket. What came during start-up is handled once the
    agent runs (a start stuck inside the driver ends with the SIGKILL that follows a
    SIGTERM's grace period). The handler itself does nothing: the interpreter writes each
    signal's number to a pipe (``set_wakeup_fd``), which the main loop reads; taking a lock
    in a handler (as ``Event.set`` does) can deadlock the main thread it interrupted.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self) -> None:
        self._read_fd = -1
        self._write_fd = -1

    def catch(self) -> None:
        """Catch the signals from now on (main thread only; safe to call twice)."""
        if self._read_fd >= 0:
            return
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._install()

    def _install(self) -> None:
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signum in self.SIGNALS:
            signal.signal(signum, self._on_signal)

    def hand_over(self) -> str:
        """Before an exec: block the signals (the mask and what is pending survive an exec,
        handlers do not) and let the pipe, with what it already holds, pass to the new
        program; the argument that tells it the pipe's ends (see ``take_over``)."""
        self.catch()
        signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        os.set_inheritable(self._read_fd, True)
        os.set_inheritable(self._write_fd, True)
        return f"{SIGNAL_FDS_FLAG}{self._read_fd},{self._write_fd}"

    def take_over(self, argument: str) -> None:
        """After the exec: the pipe from ``hand_over`` again, the handlers installed, then the
        signals unblocked: those that came in between are handled, in order, after the
        ones already in the pipe."""
        read_fd, write_fd = (int(fd) for fd in argument.removeprefix(SIGNAL_FDS_FLAG).split(","))
        os.set_inheritable(read_fd, False)
        os.set_inheritable(write_fd, False)
        self._read_fd, self._write_fd = read_fd, write_fd
        self._install()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)

    def resume(self) -> None:
        """The exec failed: unblock what ``hand_over`` blocked."""
        os.set_inheritable(self._read_fd, False)
        os.set_inheritable(self._write_fd, False)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)

    @staticmethod
    def _on_signal(_signum: int, _frame: object) -> None:
        """Nothing to do here: the wakeup pipe carries the signal's number."""

    def wait(self) -> int:
        """Sleep until one of the signals comes (or came already); its number."""
        while True:
            signum = os.read(self._read_fd, 1)[0]
            if signum in self.SIGNALS:  # another handler's signal writes to the pipe too
                return signum


class AgentCommandError(GpumonError):
    """The agent could not run; ``exit_code`` 2 for bad configuration, 1 otherwise."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exec_agent(flags: dict[str, Any], signals: SignalInbox,
               entry: list[str] | None = None) -> None:
    """Replace this process with the agent's own entry point (``python -m gpumon.agent``,
    run from the file so that it imports this same tree of gpumon), which runs
    ``run_agent``; returns only when the exec failed (then run the agent here). ``entry``:
    another program that ends in ``main`` (a benchmark's wrapper), its argv before the
    hand-over's arguments."""
    if entry is None:
        import gpumon.agent

        path = os.path.join(os.path.dirname(gpumon.agent.__file__ or ""), "__main__.py")
        # -P: no script directory at the front of sys.path; the entry puts this tree's there.
        entry = [sys.executable, "-P", path]
    argv = [*entry, signals.hand_over(), json.dumps(flags)]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # an exec drops what is buffered
    try:
        os.execv(sys.executable, argv)
    except OSError as exc:
        signals.resume()
        logging.getLogger("gpumon").warning("cannot start the agent's own entry point "
                                            "(%s); running it in the command line", exc)


def main(argv: list[str]) -> None:
    """``python -m gpumon.agent [--signal-fds=R,W] [FLAGS_JSON]``: the agent, configured by
    the flags (the ``gpumon agent`` flags' names, as JSON), the environment and the
    config file; errors as ``gpumon agent`` reports them."""
    signals = SignalInbox()
    if argv and argv[0].startswith(SIGNAL_FDS_FLAG):
        signals.take_over(argv.pop(0))
    else:
        signals.catch()
    try:
        flags = json.loads(argv[0]) if argv else {}
        if not isinstance(flags, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        print(f"gpumon: error: the flags must be a JSON object: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        run_agent(flags, signals)
    except AgentCommandError as exc:
        print(f"gpumon: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


def run_agent(flags: dict[str, Any], signals: SignalInbox) -> None:
    """Load the configuration, start the agent and serve until a stopping signal."""
    from gpumon.agent.config import ConfigError, load_config
    from gpumon.agent.lifecycle import Agent, AgentError
    from gpumon.export.server import ServeError

    signals.catch()  # already, when started from the command line
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
    try:
        # No polling: the main thread sleeps until a signal comes; any that came during
        # start-up are handled now, in order.
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
    from gpumon.agent.config import ConfigError, load_config
    from gpumon.agent.lifecycle import AgentError

    try:
        notes = node.reload(load_config(flags))
    except (ConfigError, AgentError) as exc:
        log.error("reload failed, keeping the running configuration: %s", exc)
        return
    except Exception:  # a reload must never take a running agent down with it
        log.exception("reload failed, keeping the running configuration")
        return
    log.info("configuration reloaded%s", "".join(f"; {n}" for n in notes))
