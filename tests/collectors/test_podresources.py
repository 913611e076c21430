"""The PodResources client against a real gRPC server speaking the kubelet's published proto,
served on a Unix socket in the test's directory; and the sockets that go wrong: absent, slow,
answering bytes that are not HTTP/2."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpumon.collectors.podresources import (
    DeviceHolder,
    PodResourcesError,
    api_pb2,
    api_pb2_grpc,
    list_gpu_holders,
)

GPU0 = "GPU-11111111-2222-3333-4444-555555555555"
GPU1 = "GPU-66666666-7777-8888-9999-000000000000"


class Kubelet(api_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's side of List: two pods, one with GPUs and one with another device."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def List(self, request, context):  # noqa: N802 - the proto's name
        time.sleep(self.delay_s)
        gpu = api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[GPU0, GPU1])
        nic = api_pb2.ContainerDevices(resource_name="example.com/nic", device_ids=["eth9"])
        return api_pb2.ListPodResourcesResponse(pod_resources=[
            api_pb2.PodResources(name="train-0", namespace="ml", containers=[
                api_pb2.ContainerResources(name="trainer", devices=[gpu]),
                api_pb2.ContainerResources(name="sidecar")]),
            api_pb2.PodResources(name="router", namespace="net", containers=[
                api_pb2.ContainerResources(name="r", devices=[nic])]),
        ])


def _serve(path: Path, servicer: Kubelet) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


def test_lists_gpu_holders_from_a_real_server(tmp_path):
    path = tmp_path / "kubelet.sock"
    server = _serve(path, Kubelet())
    try:
        holders = list_gpu_holders(str(path), timeout_s=2.0)
    finally:
        server.stop(None)
    assert holders == {GPU0: DeviceHolder("ml", "train-0", "trainer"),
                       GPU1: DeviceHolder("ml", "train-0", "trainer")}


def test_absent_socket_is_a_counted_kind(tmp_path):
    with pytest.raises(PodResourcesError) as err:
        list_gpu_holders(str(tmp_path / "none.sock"), timeout_s=0.5)
    assert err.value.kind == "absent"


def test_slow_kubelet_is_cut_off_by_the_timeout(tmp_path):
    path = tmp_path / "kubelet.sock"
    server = _serve(path, Kubelet(delay_s=3.0))
    try:
        started = time.monotonic()
        with pytest.raises(PodResourcesError) as err:
            list_gpu_holders(str(path), timeout_s=0.3)
        waited = time.monotonic() - started
    finally:
        server.stop(None)
    assert err.value.kind == "timeout"
    assert waited < 2.5


def test_garbage_answer_is_an_error_not_a_hang(tmp_path):
    path = tmp_path / "kubelet.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    stop = threading.Event()

    def answer_junk() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"\x00garbage, not HTTP/2\xff" * 64)
                time.sleep(0.05)

    thread = threading.Thread(target=answer_junk, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(PodResourcesError) as err:
            list_gpu_holders(str(path), timeout_s=0.5)
        waited = time.monotonic() - started
    finally:
        stop.set()
        thread.join()
        listener.close()
    assert err.value.kind in ("unavailable", "timeout", "garbage")
    assert waited < 3.0
