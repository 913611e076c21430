"""A tensor-parallel training job on CPU (gloo): a Megatron-style MLP block (``ColwiseParallel``
then ``RowwiseParallel`` through ``parallelize_module``) on a ``DeviceMesh``, launched by
``torch.distributed.run`` and unchanged (no gpumon import), so that it runs under ``gpumon run``.

With ``--dp 2`` on four ranks the mesh is 2 x 2, ``("dp", "tp")``, and the block is also
sharded over ``dp`` with FSDP2 (``fully_shard``), as a 2-D job is.

Each rank writes to ``OUT/rank<R>.json`` what DTensor itself says it issued, independently of
gpumon: torch's ``CommDebugMode`` run over one extra step after the measured ones, counting each
functional collective by kind, and the bytes of their inputs and outputs, seen from the tensors
``torch.ops._c10d_functional`` received.

    tensor_parallel_job.py --out OUT [--steps N] [--dp 1|2] [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

WIDTH = 256
BATCH = 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


FUNCTIONAL = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
              "all_to_all_single", "broadcast", "all_reduce_coalesced",
              "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"}
"""The collectives of ``torch.ops._c10d_functional`` (not its waits or wrappers)."""


class CollectiveBytes(TorchDispatchMode):
    """Bytes each ``_c10d_functional`` collective was given and returned, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.out_bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name.split(".")[-1] in FUNCTIONAL:
            short = name.split(".")[-1]
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            self.bytes[short] += sum(t.numel() * t.element_size() for t in tensors)
            outs = out if isinstance(out, (list, tuple)) else [out]
            self.out_bytes[short] += sum(t.numel() * t.element_size() for t in outs)
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dp", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = world // args.dp
    if args.dp > 1:
        mesh = init_device_mesh("cpu", (args.dp, tp), mesh_dim_names=("dp", "tp"))
        tp_mesh = mesh["tp"]
    else:
        mesh = tp_mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if args.dp > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1 + (rank // tp))  # each data-parallel replica its own batch
    x = torch.randn(BATCH, WIDTH)

    def step() -> None:
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.steps):
        step()
    comm, sizes = CommDebugMode(), CollectiveBytes()
    with comm, sizes:
        step()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    dist.barrier()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "pid": os.getpid(), "counts": counts, "bytes": dict(sizes.bytes),
         "out_bytes": dict(sizes.out_bytes), "mesh": list(mesh.mesh_dim_names or ()),
         "coordinate": mesh.get_coordinate()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
