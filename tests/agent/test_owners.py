"""Whose each rank and GPU is, end to end: an agent on the fake 8xH100 node (the unmodified
nvidia-ml-py over the fake library), a real gRPC server speaking the kubelet's PodResources proto
on a Unix socket (then gone, then too slow), and a rank sending from this test's own process,
whose /proc is real."""

from __future__ import annotations

import json
import os
import socket
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpumon.agent.collectors import owners as owners_collector
from gpumon.collectors.podresources import api_pb2, api_pb2_grpc
from gpumon.collectors.process_owner import user_name
from gpumon.collectors.samples import GpuStatic, Owner
from gpumon.export.owner_metrics import owner_families
from gpumon.state.owners import Ownership
from gpumon.testing.agent import library_agent
from gpumon.testing.fakenvml import SCENARIOS, Scenario
from tests.helpers import agent_env, start_agent, values, wait_for

NODE = "gpu-node-7"


class Kubelet(api_pb2_grpc.PodResourcesListerServicer):
    """A kubelet that allocated GPU 0 of the scenario to ml/train-0's trainer container."""

    def __init__(self, uuid: str, delay_s: float = 0.0) -> None:
        self.uuid = uuid
        self.delay_s = delay_s

    def List(self, request, context):  # noqa: N802 - the proto's name
        time.sleep(self.delay_s)
        gpu = api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[self.uuid])
        return api_pb2.ListPodResourcesResponse(pod_resources=[api_pb2.PodResources(
            name="train-0", namespace="ml",
            containers=[api_pb2.ContainerResources(name="trainer", devices=[gpu])])])


def _serve(path: Path, kubelet: Kubelet) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(kubelet, server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


def _step(run: str) -> bytes:
    return json.dumps({"v": 1, "kind": "step", "run": run, "rank": 0, "step": 0,
                       "duration": 0.1}).encode()


def test_ranks_and_gpus_carry_their_owners(tmp_path: Path, fake_nvml_lib: Path) -> None:
    scenario = Scenario.load(SCENARIOS / "h100_8x.scn")
    uuid0 = scenario.gpu(0)["uuid"]
    kubelet_socket = tmp_path / "pod-resources" / "kubelet.sock"
    kubelet_socket.parent.mkdir()
    server = _serve(kubelet_socket, Kubelet(uuid0))
    env = agent_env(fake_nvml_lib.parent, SCENARIOS / "h100_8x.scn",
                    {"GPUMON_NODE_NAME": NODE, "GPUMON_POD_RESOURCES_SOCKET": str(kubelet_socket)})
    agent = start_agent(tmp_path, "--interval", "0.25", env=env)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(_step("owned"), str(agent.socket_path))
        wait_for(lambda: values(agent.metrics(), "gpumon_rank_info", run="owned", node=NODE,
                                user=user_name(os.getuid())), what="the rank's owner")
        gone = [p for p in ("41003", "40876") if not Path(f"/proc/{p}").exists()]
        for pid in gone:  # no such process here: the GPU's holder is the kubelet's container
            # (the rank is attributed as its first step arrives, the GPU's holders at the
            # owners cycle that reads the kubelet: the two need not land in one scrape)
            wait_for(lambda pid=pid: values(agent.metrics(), "gpumon_gpu_owner_info", gpu="0",
                                            pid=pid, pod="train-0", namespace="ml",
                                            container="trainer", node=NODE),
                     timeout=15, what=f"GPU 0's holder {pid} in the kubelet's container")
        assert values(agent.metrics(), "gpumon_gpu_owner_info", gpu="5", pid="51234",
                      node=NODE), "a holder without a rank is still listed"
        # The kubelet goes away: counted as the kubelet collector's error, the rest goes on.
        server.stop(None)
        kubelet_socket.unlink(missing_ok=True)
        wait_for(lambda: values(agent.metrics(), "gpumon_collector_errors_total",
                                collector="kubelet", error="absent"),
                 timeout=15, what="the absent kubelet counted")
        metrics = agent.metrics()
        assert not values(metrics, "gpumon_gpu_owner_info", pod="train-0")
        assert len(values(metrics, "gpumon_gpu_up")) == 8
        assert values(metrics, "gpumon_rank_info", run="owned", node=NODE)
        # A kubelet that answers too slowly: cut off by the timeout and counted, the rest goes on.
        server = _serve(kubelet_socket, Kubelet(uuid0, delay_s=10.0))
        wait_for(lambda: values(agent.metrics(), "gpumon_collector_errors_total",
                                collector="kubelet", error="timeout"),
                 timeout=20, what="the slow kubelet counted")
        metrics = agent.metrics()
        assert len(values(metrics, "gpumon_gpu_up")) == 8
        assert values(metrics, "gpumon_rank_info", run="owned", node=NODE)
    finally:
        server.stop(None)
        assert agent.stop() == 0, agent.log()


def test_a_gpu_allocated_but_held_by_no_listed_process_has_its_container_as_holder() -> None:
    gpu = GpuStatic(index=3, uuid="GPU-3", name="H100", pci_bus_id="0000:03:00.0")
    trainer = Owner(node="n", pod="p", namespace="ns", container="c")
    mine = Owner(node="n", user="alice", slurm_job="42", slurm_step="0")
    ownership = Ownership(node="n", by_pid={7: mine}, allocated={"GPU-3": trainer})
    family, = owner_families(ownership, [gpu], {}, {})
    assert [s.labels for s in family.samples] == [
        {"gpu": "3", "uuid": "GPU-3", "pid": "", "run": "", "rank": "", "node": "n", "pod": "p",
         "namespace": "ns", "container": "c", "slurm_job": "", "slurm_step": "", "user": ""}]
    family, = owner_families(ownership, [gpu], {3: [7, 8]}, {7: ("train", 2)})
    rows = {s.labels["pid"]: s.labels for s in family.samples}
    assert rows["7"]["user"] == "alice" and rows["7"]["slurm_job"] == "42"
    assert (rows["7"]["run"], rows["7"]["rank"]) == ("train", "2")
    assert rows["8"]["pod"] == "p" and rows["8"]["user"] == ""  # unseen: the kubelet's word


def test_a_rank_is_attributed_at_its_first_step_not_at_the_next_cycle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Cycles an hour apart: only the wake a new sender brings can attribute the rank in time.
    monkeypatch.setattr(owners_collector, "OWNERS_INTERVAL_S", 3600.0)
    with library_agent(tmp_path / "s.sock", collectors=("ingest", "owners"),
                       node_name=NODE) as agent:
        wait_for(lambda: agent.state.collector("owners", 3600.0).last_success_t,
                 what="the first owners cycle")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(_step("late"), agent.config.socket)
        wait_for(lambda: agent.owners.get().of_pid(os.getpid()).user == user_name(os.getuid()),
                 timeout=10, what="the new rank's owner")
