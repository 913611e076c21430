"""The kubelet's PodResources API: which pod's container each GPU of the node is allocated to.

The kubelet serves it on a Unix socket of the node (``/var/lib/kubelet/pod-resources/
kubelet.sock``, mounted read-only into the DaemonSet). ``List`` is the v1 call every kubelet
since 1.20 answers; ``Get`` needs a feature gate and a pod's name, which is what is looked
for. The messages and the service come from the published ``api.proto``, kept here unchanged
with the code ``grpc_tools.protoc`` generates from it.

A device plugin names each device it hands out: NVIDIA's names a GPU by its UUID, the one NVML
reports, so a GPU joins its pod on ``uuid`` alone. The response carries no pod UID and no
container id: names for a process come from its container (``collectors.container_logs``);
this API is what names a GPU's holder where no process can be seen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from gpumon.collectors.podresources import api_pb2, api_pb2_grpc
from gpumon.errors import GpumonError

GPU_RESOURCES = ("nvidia.com/gpu",)
"""Resource names whose device ids are GPU UUIDs (MIG and shared GPUs use others)."""


@dataclass(frozen=True, slots=True)
class DeviceHolder:
    """The pod and container a device is allocated to."""

    namespace: str
    pod: str
    container: str


class PodResourcesError(GpumonError):
    """The kubelet could not be asked; ``kind`` is the collector-error label."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def list_gpu_holders(socket_path: str, timeout_s: float) -> dict[str, DeviceHolder]:
    """GPU UUID -> the container it is allocated to, from one ``List`` call.

    Raises PodResourcesError (kind ``absent``, ``timeout``, ``unavailable``, ``garbage`` or the
    gRPC status code's name): the call is bounded by ``timeout_s`` whatever the socket does.
    """
    if not os.path.exists(socket_path):
        raise PodResourcesError("absent", f"no kubelet socket at {socket_path}")
    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        stub = api_pb2_grpc.PodResourcesListerStub(channel)
        try:
            response = stub.List(api_pb2.ListPodResourcesRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        except DecodeError as exc:
            raise PodResourcesError("garbage", f"undecodable answer: {exc}") from None
    holders: dict[str, DeviceHolder] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name not in GPU_RESOURCES:
                    continue
                for device_id in devices.device_ids:
                    holders[device_id] = DeviceHolder(pod.namespace, pod.name, container.name)
    return holders


def _error(exc: grpc.RpcError) -> PodResourcesError:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return PodResourcesError("timeout", "the kubelet did not answer in time")
    if code is grpc.StatusCode.UNAVAILABLE:
        return PodResourcesError("unavailable", f"cannot reach the kubelet: {details}")
    if code is grpc.StatusCode.INTERNAL:  # a response that is not the message: garbage
        return PodResourcesError("garbage", f"unreadable answer: {details}")
    name = code.name.lower() if code is not None else "rpc"
    return PodResourcesError(name, f"kubelet answered {name}: {details}")
