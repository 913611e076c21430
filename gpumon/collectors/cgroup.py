"""Where a process sits, read from the text of its ``/proc/<pid>/cgroup``: a pure parser.

The kernel writes that file, and kubelet and Slurm name the cgroups they make, so the pod UID,
the container id and the Slurm job and step in it are not the process's own claim. The shapes
recognised are the ones they write:

- kubelet, systemd driver (cgroup v1 and v2), containerd, CRI-O or Docker:
  ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope``
  (``crio-<id>.scope``, ``docker-<id>.scope``; Guaranteed pods have no QoS level; the UID's
  dashes are underscores);
- kubelet, cgroupfs driver: ``/kubepods/burstable/pod<uid>/<id>``;
- Slurm's cgroup/v1 plugin: ``/slurm/uid_<uid>/job_<id>/step_<step>/task_<n>``
  (``/slurm_<node>/...`` where several slurmd share a host);
- Slurm's cgroup/v2 plugin: ``/system.slice/slurmstepd.scope/job_<id>/step_<step>/user/task_<n>``.

Each is matched by its own components wherever it sits in the path, so a prefix (a cgroup
namespace's ``/..`` parts, a kind node's ``/kubelet.slice`` and ``kubelet-`` prefix) does not
hide it. Anything else,
or lines that disagree (two pods), gives an empty place: never a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_SLICE = re.compile(
    rf"^(?:kubelet-)?kubepods(?:-(?:burstable|besteffort|guaranteed))?-pod({_UID})\.slice$")
_POD_DIR = re.compile(rf"^pod({_UID})$")
_CONTAINER_ID = r"[0-9a-f]{64}"
_CONTAINER_SCOPE = re.compile(rf"^(?:cri-containerd|crio|docker)-({_CONTAINER_ID})\.scope$")
_CONTAINER_DIR = re.compile(rf"^({_CONTAINER_ID})$")
_SLURM_ROOT = re.compile(r"^slurm(?:_[A-Za-z0-9._-]+)?$")
_SLURM_UID = re.compile(r"^uid_(\d+)$")
_SLURM_JOB = re.compile(r"^job_(\d+)$")
_SLURM_STEP = re.compile(r"^step_(\d+|batch|extern|interactive)$")


@dataclass(frozen=True, slots=True)
class CgroupPlace:
    """A process's pod and container, or Slurm job and step, as its cgroup names them."""

    pod_uid: str = ""
    container_id: str = ""
    slurm_job: str = ""
    slurm_step: str = ""
    slurm_uid: str = ""


EMPTY = CgroupPlace()


def parse_cgroup(text: str) -> CgroupPlace:
    """The place the lines of a ``/proc/<pid>/cgroup`` name; EMPTY when none or ambiguous."""
    places = set()
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        place = parse_path(parts[2])
        if place != EMPTY:
            places.add(place)
    if len(places) != 1:
        return EMPTY
    return places.pop()


def parse_path(path: str) -> CgroupPlace:
    """The place one cgroup path names; EMPTY for a shape this module does not know."""
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    return _kubernetes(parts) or _slurm_v1(parts) or _slurm_v2(parts) or EMPTY


def _kubernetes(parts: list[str]) -> CgroupPlace | None:
    for i, part in enumerate(parts):
        pod = _POD_SLICE.match(part)
        scope = _CONTAINER_SCOPE
        if pod is None and "kubepods" in parts[max(0, i - 2):i]:
            pod = _POD_DIR.match(part)
            scope = _CONTAINER_DIR
        if pod is None:
            continue
        container = ""
        if i + 1 < len(parts):
            found = scope.match(parts[i + 1])
            if found is None:  # a pod's own cgroup holds containers, nothing else we know
                return None
            container = found.group(1)
        return CgroupPlace(pod_uid=pod.group(1).replace("_", "-"), container_id=container)
    return None


def _slurm_v1(parts: list[str]) -> CgroupPlace | None:
    for i in range(len(parts) - 2):
        if not _SLURM_ROOT.match(parts[i]):
            continue
        uid, job = _SLURM_UID.match(parts[i + 1]), _SLURM_JOB.match(parts[i + 2])
        if uid is None or job is None:
            return None
        step = _SLURM_STEP.match(parts[i + 3]) if i + 3 < len(parts) else None
        return CgroupPlace(slurm_job=job.group(1), slurm_step=step.group(1) if step else "",
                           slurm_uid=uid.group(1))
    return None


def _slurm_v2(parts: list[str]) -> CgroupPlace | None:
    for i in range(len(parts) - 1):
        if parts[i] != "slurmstepd.scope":
            continue
        job = _SLURM_JOB.match(parts[i + 1])
        if job is None:  # slurmstepd's own cgroup (``system``) or a shape we do not know
            return None
        step = _SLURM_STEP.match(parts[i + 2]) if i + 2 < len(parts) else None
        return CgroupPlace(slurm_job=job.group(1), slurm_step=step.group(1) if step else "")
    return None
