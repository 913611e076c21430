"""Pod and container names by container id, from the links kubelet keeps in /var/log/containers.

For every container it runs, kubelet links ``/var/log/containers/<pod>_<namespace>_<container>-
<container id>.log`` to the container's log. Pod, namespace and container names cannot hold an
underscore and the id is 64 hex digits, so each name reads back unambiguously. This is how a
process's container id, from its cgroup, gets names a person knows: the PodResources API
carries neither pod UIDs nor container ids, and the names come from kubelet, never from the
process. Only the directory is listed; no link is followed and no log is read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

CONTAINER_LOGS = "/var/log/containers"
_NAME = r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?"
_LINK = re.compile(rf"^(?P<pod>{_NAME})_(?P<namespace>{_NAME})_(?P<container>{_NAME})"
                   r"-(?P<id>[0-9a-f]{64})\.log$")


@dataclass(frozen=True, slots=True)
class ContainerName:
    """A container's names in the cluster."""

    namespace: str
    pod: str
    container: str


def parse_link_name(name: str) -> tuple[str, ContainerName] | None:
    """(container id, names) from one link's file name; None for any other name."""
    found = _LINK.match(name)
    if found is None:
        return None
    return found["id"], ContainerName(found["namespace"], found["pod"], found["container"])


def container_names(directory: str = CONTAINER_LOGS) -> dict[str, ContainerName]:
    """Container id -> names, for every link in ``directory`` (empty where it is absent)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return {}
    out = {}
    for entry in entries:
        parsed = parse_link_name(entry)
        if parsed is not None:
            out[parsed[0]] = parsed[1]
    return out
