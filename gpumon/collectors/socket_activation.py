"""The ingest socket handed over by the service manager (systemd socket activation).

A socket the service manager holds outlives the agent: datagrams sent while the agent
restarts wait in the kernel's queue instead of failing with "no agent", and the new agent
reads them first. The protocol is ``sd_listen_fds``': ``LISTEN_PID`` names this process,
``LISTEN_FDS`` counts the descriptors passed from fd 3 on, ``LISTEN_FDNAMES`` (optional)
names them. The agent takes the one bound to its configured path; one that is not a Unix
datagram socket, or is bound elsewhere, is a configuration mistake said plainly, never a
socket quietly bound beside it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

from gpumon.errors import GpumonError

LISTEN_FDS_START = 3
_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


class ActivationError(GpumonError, RuntimeError):
    """The descriptors handed over cannot serve as the ingest socket; the message says why."""


def inherited_socket(path: str, environ: MutableMapping[str, str] | None = None,
                     pid: int | None = None) -> socket.socket | None:
    """The Unix datagram socket bound to ``path`` that the service manager passed, or None
    when it passed none (then the agent binds its own). The variables are removed from
    ``environ`` (``os.environ``) so that nothing the agent starts takes them for its own."""
    env = os.environ if environ is None else environ
    listen_pid, listen_fds = env.get("LISTEN_PID"), env.get("LISTEN_FDS")
    names = env.get("LISTEN_FDNAMES")
    for name in _VARIABLES:
        env.pop(name, None)
    if not listen_fds:
        return None
    if listen_pid is not None and listen_pid != str(os.getpid() if pid is None else pid):
        return None  # meant for another process (a parent that did not unset them)
    try:
        count = int(listen_fds)
    except ValueError:
        raise ActivationError(f"LISTEN_FDS={listen_fds!r} is not a number") from None
    labels = names.split(":") if names else []
    found: socket.socket | None = None
    seen: list[str] = []
    for offset in range(count):
        fd = LISTEN_FDS_START + offset
        label = labels[offset] if offset < len(labels) else f"fd {fd}"
        sock = _adopt(fd, label)
        bound = _bound_path(sock)
        if found is None and bound is not None \
                and os.path.realpath(bound) == os.path.realpath(path):
            found = sock
        else:
            seen.append(f"{label}: {bound or 'unnamed'}")
            sock.close()
    if found is None:
        raise ActivationError(f"the service manager passed {count} socket(s) but none bound to "
                              f"{path} ({'; '.join(seen) or 'none'}): point the socket unit's "
                              f"ListenDatagram= and the agent's --socket at the same path")
    return found


def _adopt(fd: int, label: str) -> socket.socket:
    """The socket on ``fd``, checked to be a Unix datagram socket, close-on-exec."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ActivationError(f"the service manager's {label} is not a socket: "
                              f"{exc.strerror or exc}") from None
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_DGRAM:
        kind = f"{socket.AddressFamily(sock.family).name} {socket.SocketKind(sock.type).name}"
        sock.detach()  # not ours to close: it may be a listener meant for something else
        raise ActivationError(f"the service manager's {label} is a {kind} socket; the ingest "
                              f"socket must be AF_UNIX SOCK_DGRAM (ListenDatagram= of a path)")
    os.set_inheritable(fd, False)
    return sock


def _bound_path(sock: socket.socket) -> str | None:
    name = sock.getsockname()
    if isinstance(name, bytes):  # an abstract-namespace address
        return None
    return name or None
