"""Attribution of live processes placed in real cgroups, shaped as kubelet and Slurm make them.

Where this process may create cgroups (root, or a delegated cgroup v2 subtree), each test
starts a process, moves it into a cgroup of the real file system named as kubelet (cgroupfs
driver) or Slurm's cgroup/v1 plugin name theirs, and lets the owner collector read it through
the real /proc. Elsewhere the tests skip: the parser's table (test_cgroup.py) still runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumon.agent.owners import OwnerCollector
from gpumon.collectors.process_owner import user_name
from gpumon.collectors.samples import Owner
from gpumon.state.owners import OwnerState

NODE = "node-under-test"


def _hierarchy() -> Path | None:
    """A cgroup hierarchy this process can create cgroups in and move processes within."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mount, kind, options = Path(fields[1]), fields[2], fields[3].split(",")
        if kind == "cgroup2" or (kind == "cgroup" and "pids" in options):
            if os.access(mount, os.W_OK) and os.access(mount / "cgroup.procs", os.W_OK):
                return mount
    return None


class Placed:
    """A sleeping process in a cgroup made for it; removed, with the cgroups, at the end."""

    def __init__(self, root: Path, relative: str) -> None:
        self.root = root
        self.cgroup = root / relative.strip("/")
        self.made = [p for p in [self.cgroup, *self.cgroup.parents] if p != root
                     and root in p.parents and not p.exists()]
        self.cgroup.mkdir(parents=True)
        self.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        (self.cgroup / "cgroup.procs").write_text(str(self.process.pid))

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        for path in self.made:  # deepest first
            path.rmdir()


@pytest.fixture
def place() -> Iterator:
    root = _hierarchy()
    if root is None:
        pytest.skip("no cgroup hierarchy this process may write to")
    placed: list[Placed] = []

    def make(relative: str) -> Placed:
        try:
            placed.append(Placed(root, f"gpumon-test-{uuid.uuid4().hex[:8]}/{relative}"))
        except OSError as exc:
            pytest.skip(f"cannot make a cgroup here: {exc}")
        return placed[-1]

    yield make
    for p in placed:
        p.close()
    for p in placed:
        top = p.root / p.cgroup.relative_to(p.root).parts[0]
        if top.exists():
            top.rmdir()


def _collect(pid: int, containers: Path) -> Owner | None:
    state = OwnerState(NODE)
    OwnerCollector(state, "/nonexistent/kubelet.sock", containers_dir=str(containers)).collect([pid])
    return state.get().by_pid.get(pid)


def test_a_process_in_a_pods_container_is_named_by_kubelets_links(place, tmp_path: Path) -> None:
    pod_uid, container_id = str(uuid.uuid4()), os.urandom(32).hex()
    placed = place(f"kubepods/burstable/pod{pod_uid}/{container_id}")
    links = tmp_path / "containers"
    links.mkdir()
    (links / f"llm-worker-0_research_trainer-{container_id}.log").symlink_to(tmp_path / "absent")
    (links / f"other-pod_research_trainer-{os.urandom(32).hex()}.log").symlink_to(tmp_path / "x")
    assert _collect(placed.pid, links) == Owner(
        node=NODE, pod="llm-worker-0", namespace="research", container="trainer",
        user=user_name(os.getuid()))


def test_a_process_of_a_slurm_step_is_its_job_and_step(place, tmp_path: Path) -> None:
    placed = place(f"slurm/uid_{os.getuid()}/job_4242/step_0/task_0")
    assert _collect(placed.pid, tmp_path) == Owner(node=NODE, slurm_job="4242", slurm_step="0",
                                                   user=user_name(os.getuid()))


def test_a_container_kubelet_does_not_name_has_no_pod_name(place, tmp_path: Path) -> None:
    placed = place(f"kubepods/pod{uuid.uuid4()}/{os.urandom(32).hex()}")
    assert _collect(placed.pid, tmp_path) == Owner(node=NODE, user=user_name(os.getuid()))


def test_a_process_that_exited_before_it_was_read_is_left_out(place, tmp_path: Path) -> None:
    placed = place("slurm/uid_0/job_1/step_0")
    placed.process.kill()
    placed.process.wait()
    assert _collect(placed.pid, tmp_path) is None
