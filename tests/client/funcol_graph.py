"""Counts the graph breaks ``torch._dynamo.explain`` finds in a function of functional
collectives (DTensor's path), in a world of one, with the communication tap installed or not:

    funcol_graph.py tap|plain   -> prints {"breaks": N, "graphs": M, "ops": [...]} as JSON
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.distributed as dist


def main() -> None:
    store = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    if sys.argv[1] == "tap":
        from gpumon.client.comm.tap import install_tap

        assert install_tap()
    from torch.distributed import _functional_collectives as funcol

    def f(x: torch.Tensor) -> torch.Tensor:
        y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
        z = funcol.all_gather_tensor(y + 1, 0, dist.group.WORLD)
        w = funcol.reduce_scatter_tensor(z * 3, "sum", 0, dist.group.WORLD)
        return funcol.all_to_all_single(w, None, None, dist.group.WORLD).sum()

    explained = torch._dynamo.explain(f)(torch.randn(8))
    ops = sorted({str(node.target) for graph in explained.graphs for node in graph.graph.nodes
                  if "c10d_functional" in str(node.target)})
    print(json.dumps({"breaks": explained.graph_break_count, "graphs": explained.graph_count,
                      "ops": ops}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
