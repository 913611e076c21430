"""A stand-in for the service manager's part in socket activation: hold the socket, restart
the service on it.

Run under ``systemd-socket-activate --datagram -l PATH``, which binds PATH and execs this
module with the socket on fd 3: it keeps that fd for its whole life (as systemd keeps a
``.socket`` unit's) and starts each agent with it, under ``LISTEN_FDS``/``LISTEN_PID`` as
systemd sets them for a service. Driven by lines on stdin, answering on stdout:

    start ["gpumon", "agent", ...]   ->  pid N
    stop                             ->  exited RC    (SIGTERM, then wait)

End of input stops the running agent, if any, and ends the holder (and the socket with it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

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
            env = dict(os.environ, LISTEN_FDS="1", LISTEN_FDNAMES="ingest")
            agent = subprocess.Popen(["sh", "-c", _EXPORT_PID, *json.loads(rest)], env=env,
                                     pass_fds=(LISTEN_FD,), stdin=subprocess.DEVNULL)
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


if __name__ == "__main__":
    main()
