"""A stand-in for the service manager's part in socket activation: hold the socket, restart
the service on it.

Run under ``systemd-socket-activate --datagram -l PATH``, which binds PATH and execs this
module with the socket on fd 3: it keeps that fd for its whole life (as systemd keeps a
``.socket`` unit's) and starts each agent with it, under ``LISTEN_FDS``/``LISTEN_PID`` as
systemd sets them for a service. Driven by lines on stdin, answering on stdout:

    start {"argv": ["gpumon", "agent", ...], "log": PATH}   ->  pid N
    stop                                                    ->  exited RC  (SIGTERM, then wait)

End of input stops the running agent, if any, and ends the holder (and the socket with it).
``HeldSocket`` drives one from a test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

LISTEN_FD = 3
_EXPORT_PID = 'export LISTEN_PID=$$; exec "$0" "$@"'
"""The shell's pid is the agent's (exec keeps it): LISTEN_PID names the process itself."""


def main() -> None:
    """Serve ``start``/``stop`` lines until end of input."""
    os.set_inheritable(LISTEN_FD, True)
    agent: subprocess.Popen[bytes] | None = None
    for line in sys.stdin:
        verb, _, rest = line.strip().partition(" ")
        if verb == "start":
            order = json.loads(rest)
            env = dict(os.environ, LISTEN_FDS="1", LISTEN_FDNAMES="ingest")
            with open(order["log"], "ab") as log:
                agent = subprocess.Popen(["sh", "-c", _EXPORT_PID, *order["argv"]], env=env,
                                         pass_fds=(LISTEN_FD,), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
            print(f"pid {agent.pid}", flush=True)
        elif verb == "stop" and agent is not None:
            print(f"exited {_stop(agent)}", flush=True)
            agent = None
        else:
            print(f"error: {line.strip()!r}", flush=True)
    if agent is not None:
        _stop(agent)


def _stop(agent: subprocess.Popen[bytes]) -> int:
    agent.send_signal(signal.SIGTERM)
    try:
        return agent.wait(30)
    except subprocess.TimeoutExpired:
        agent.kill()
        return agent.wait()


class HeldSocket:
    """``systemd-socket-activate`` holding a datagram socket at ``path``, with this module as
    the service manager that restarts agents on it."""

    def __init__(self, path: Path, env: Mapping[str, str], cwd: Path) -> None:
        self.path = path
        passed = [f"--setenv={name}={value}" for name, value in env.items()
                  if name not in ("HOME", "TERM", "PATH")]
        self._process = subprocess.Popen(
            ["systemd-socket-activate", "--datagram", f"--listen={path}", *passed,
             sys.executable, "-m", "gpumon.testing.socket_holder"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=cwd)
        deadline = time.monotonic() + 10
        while not path.exists():
            if time.monotonic() > deadline or self._process.poll() is not None:
                raise AssertionError("systemd-socket-activate did not bind its socket")
            time.sleep(0.02)
        # It execs its command at the socket's first datagram; an empty one carries nothing.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(b"", str(path))

    def start(self, argv: Sequence[str], log: Path) -> int:
        """Start an agent on the held socket; its pid."""
        return int(self._ask("start " + json.dumps({"argv": list(argv), "log": str(log)}), "pid"))

    def stop(self) -> int:
        """SIGTERM the running agent and wait for it; its exit status."""
        return int(self._ask("stop", "exited"))

    def _ask(self, line: str, answer: str) -> str:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(line.encode() + b"\n")
        self._process.stdin.flush()
        reply = self._process.stdout.readline().decode().split()
        assert reply[:1] == [answer], f"socket holder answered {reply!r} to {line!r}"
        return reply[1]

    def close(self) -> None:
        """Stop the agent, if one runs, and the holder."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(40)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


if __name__ == "__main__":
    main()
