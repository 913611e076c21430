"""The cgroup parser over a table of paths shaped as kubelet (containerd, CRI-O, Docker; systemd
and cgroupfs drivers; cgroup v1 and v2) and Slurm's cgroup plugins write them, and over shapes
it must not guess at."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from gpumon.collectors import process_owner
from gpumon.collectors.cgroup import EMPTY, CgroupPlace, parse_cgroup
from gpumon.collectors.container_logs import ContainerName, container_names, parse_link_name
from gpumon.collectors.process_owner import read_process, user_name

UID = "8e3bc9c3-2d0c-4b61-a6a4-0a2b6f1d9c11"
SYSTEMD_UID = UID.replace("-", "_")
CID = "4f797c539e6c745de61a93ca3ff892358ecbcaccd8414d5db545c38428142970"
POD = CgroupPlace(pod_uid=UID, container_id=CID)

CASES = [
    # kubelet, systemd driver, cgroup v2, containerd
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/"
     f"cri-containerd-{CID}.scope", POD),
    (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SYSTEMD_UID}.slice/"
     f"cri-containerd-{CID}.scope", POD),
    # Guaranteed QoS: no level in the path
    (f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope", POD),
    # CRI-O and Docker scopes
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/"
     f"crio-{CID}.scope", POD),
    (f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/docker-{CID}.scope", POD),
    # seen from inside another cgroup namespace, and on a kind node
    (f"0::/../../kubepods-besteffort-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope", POD),
    (f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
     f"kubelet-kubepods-besteffort-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope", POD),
    # cgroup v1, cgroupfs driver, one line per hierarchy
    ("\n".join(f"{n}:{c}:/kubepods/burstable/pod{UID}/{CID}"
               for n, c in ((12, "memory"), (11, "devices"), (4, "cpu,cpuacct"))), POD),
    (f"11:memory:/kubepods/pod{UID}/{CID}", POD),
    # cgroup v1, systemd driver
    (f"9:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/"
     f"crio-{CID}.scope\n1:name=systemd:/kubepods.slice/kubepods-burstable.slice/"
     f"kubepods-burstable-pod{SYSTEMD_UID}.slice/crio-{CID}.scope", POD),
    # the pod's own cgroup (the pause process under cgroupfs): a pod, no container
    (f"0::/kubepods/besteffort/pod{UID}", CgroupPlace(pod_uid=UID)),
    # CRI-O's conmon beside the container: not the container
    (f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/crio-conmon-{CID}.scope", EMPTY),
    # Slurm cgroup/v1
    ("7:memory:/slurm/uid_1000/job_4242/step_0/task_1\n"
     "5:cpuset:/slurm/uid_1000/job_4242/step_0",
     CgroupPlace(slurm_job="4242", slurm_step="0", slurm_uid="1000")),
    ("4:devices:/slurm_node07/uid_1000/job_4242/step_batch/task_0",
     CgroupPlace(slurm_job="4242", slurm_step="batch", slurm_uid="1000")),
    # Slurm cgroup/v2
    ("0::/system.slice/slurmstepd.scope/job_4242/step_3/user/task_0",
     CgroupPlace(slurm_job="4242", slurm_step="3")),
    ("0::/system.slice/slurmstepd.scope/job_4242/step_extern/user/task_special",
     CgroupPlace(slurm_job="4242", slurm_step="extern")),
    ("0::/system.slice/slurmstepd.scope/system", EMPTY),  # slurmstepd itself
    # not a job's: a user session, a plain service, Docker outside Kubernetes
    ("0::/user.slice/user-1000.slice/session-3.scope", EMPTY),
    ("0::/system.slice/gpumon.service", EMPTY),
    (f"0::/system.slice/docker-{CID}.scope", EMPTY),
    ("0::/", EMPTY),
    # broken or hostile text: never a crash, never a name
    ("", EMPTY),
    ("garbage\n\x00\xff:::", EMPTY),
    (f"0::/kubepods.slice/kubepods-podNOT-A-UID.slice/cri-containerd-{CID}.scope", EMPTY),
    (f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/cri-containerd-{CID[:12]}.scope", EMPTY),
    ("0::/slurm/uid_x/job_1/step_0", EMPTY),
    ("0::/system.slice/slurmstepd.scope/job_abc/step_0", EMPTY),
    # two lines naming two different pods: ambiguous, so nothing
    (f"12:memory:/kubepods/pod{UID}/{CID}\n"
     f"11:devices:/kubepods/pod{UID[:-1]}0/{CID}", EMPTY),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse_cgroup(text, expected):
    assert parse_cgroup(text) == expected


def test_container_log_links():
    link = f"train-0_ml_trainer-{CID}.log"
    assert parse_link_name(link) == (CID, ContainerName("ml", "train-0", "trainer"))
    assert parse_link_name(f"train_0_ml_trainer-{CID}.log") is None
    assert parse_link_name("README") is None


def test_container_names_from_a_directory(tmp_path):
    (tmp_path / f"web-7d9f_default_nginx-{CID}.log").symlink_to(tmp_path / "missing")
    (tmp_path / "junk.txt").write_text("x")
    assert container_names(str(tmp_path)) == {CID: ContainerName("default", "web-7d9f", "nginx")}
    assert container_names(str(tmp_path / "absent")) == {}


def test_reads_this_process_and_a_fake_proc(tmp_path):
    facts = read_process(os.getpid())
    assert facts is not None and facts.user == user_name(os.getuid())
    proc = tmp_path / "4242"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_77/step_0/user/task_0\n")
    (proc / "status").write_text(f"Name:\tpython\nUid:\t{os.getuid()}\t0\t0\t0\n")
    facts = read_process(4242, proc=tmp_path)
    assert facts is not None
    assert facts.place == CgroupPlace(slurm_job="77", slurm_step="0")
    assert read_process(999999, proc=tmp_path) is None  # exited between listing and reading


def test_a_slurm_cgroup_of_another_uid_is_not_believed(tmp_path):
    proc = tmp_path / "9"
    proc.mkdir()
    (proc / "cgroup").write_text("4:memory:/slurm/uid_1/job_5/step_0/task_0\n")
    (proc / "status").write_text("Uid:\t2\t2\t2\t2\n")
    facts = read_process(9, proc=tmp_path)
    assert facts is not None and facts.place == EMPTY


def test_a_users_name_is_asked_of_the_user_database_once_while_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The database stands in for a directory server (each lookup a network round trip).
    asked: list[int] = []

    def getpwuid(uid: int) -> SimpleNamespace:
        asked.append(uid)
        if uid == 4243:
            raise KeyError(uid)
        return SimpleNamespace(pw_name=f"user{uid}")

    monkeypatch.setattr(process_owner.pwd, "getpwuid", getpwuid)
    monkeypatch.setattr(process_owner, "_user_names", {})
    assert [user_name(4242) for _ in range(5)] == ["user4242"] * 5
    assert [user_name(4243) for _ in range(3)] == ["4243"] * 3  # no entry: the number, kept
    assert asked == [4242, 4243]
    monkeypatch.setattr(process_owner, "USER_NAME_KEPT_S", 0.0)  # kept time over: asked again
    assert user_name(4242) == "user4242" and asked == [4242, 4243, 4242]
