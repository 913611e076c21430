"""Where a rank sits in its job's parallelism, as the hook finds it and tells the agent: a real
``DeviceMesh`` in a world of one (its dimension names mapped, one it does not know kept as
given, a mesh made after ``watch()`` picked up), the monitor's own ``parallel`` argument (which
wins), and what a bad one raises."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from gpumon.client import StepMonitor
from gpumon.client.core.transport import MemoryTransport
from gpumon.client.watchers.layout import layout_of_mesh, merge, watch_layout
from gpumon.wire import HelloRecord, ParallelLayout

pytestmark = pytest.mark.usefixtures("world_of_one")


def hellos(transport: MemoryTransport) -> list[HelloRecord]:
    return [r for r in transport.records() if isinstance(r, HelloRecord)]


def test_a_meshs_names_are_mapped_and_data_parallel_dimensions_flattened() -> None:
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    assert layout_of_mesh(mesh) == ParallelLayout(dp=0, tp=0, source="mesh")
    assert layout_of_mesh(mesh["tp"]) == ParallelLayout(dp=0, tp=0, source="mesh")  # its root's


def test_a_dimension_of_another_name_is_kept_as_the_job_named_it() -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replica_group", "pp"))
    assert layout_of_mesh(mesh) == ParallelLayout(pp=0, source="mesh",
                                                  other=(("replica_group", 0),))


def test_a_mesh_without_names_gives_no_layout() -> None:
    assert layout_of_mesh(init_device_mesh("cpu", (1,))) is None


def test_a_mesh_made_after_watch_is_picked_up_at_the_next_step() -> None:
    transport = MemoryTransport()
    mon = StepMonitor(run="unit", transport=transport, rank=0, world=1)
    try:
        watch_layout(mon, torch.nn.Linear(2, 2))
        with mon.step():
            pass
        mon.flush()
        assert all(h.parallel is None for h in hellos(transport))
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep"))  # the job keeps it
        with mon.step():
            pass
        mon.flush()
        assert hellos(transport)[-1].parallel == ParallelLayout(dp=0, ep=0, source="mesh")
        assert mesh.mesh_dim_names == ("dp", "ep")
    finally:
        mon.close()


def test_the_callers_word_wins_dimension_by_dimension() -> None:
    transport = MemoryTransport()
    mon = StepMonitor(run="unit", transport=transport, rank=0, world=1,
                      parallel={"pp": 3, "dp": 5})
    try:
        mon.flush()
        assert hellos(transport)[0].parallel == ParallelLayout(dp=5, pp=3, source="argument")
        watch_layout(mon, torch.nn.Linear(2, 2))
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        with mon.step():
            pass
        mon.flush()
        assert hellos(transport)[-1].parallel == ParallelLayout(dp=5, tp=0, pp=3,
                                                                source="argument/mesh")
        assert mesh.mesh_dim_names == ("dp", "tp")
    finally:
        mon.close()


@pytest.mark.parametrize("parallel", [{"pp": -1}, {"pp": 1.0}, {"pp": True}, {"bad name": 0},
                                      {"tp": 1 << 20}])
def test_a_bad_parallel_argument_is_refused_with_a_clear_message(parallel: dict) -> None:
    with pytest.raises(ValueError, match="parallel"):
        StepMonitor(run="unit", transport=MemoryTransport(), rank=0, world=1, parallel=parallel)


def test_merge_takes_each_dimension_from_the_first_that_names_it() -> None:
    merged = merge([ParallelLayout(pp=1, source="pipeline"), None,
                    ParallelLayout(dp=2, pp=0, source="mesh", other=(("x", 1),))])
    assert merged == ParallelLayout(dp=2, pp=1, source="pipeline/mesh", other=(("x", 1),))
    assert merge([None]) is None
