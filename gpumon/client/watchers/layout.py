"""Where a rank sits in its job's parallelism: its index along data, tensor, pipeline, expert
and context parallelism (``wire.ParallelLayout``), read from whichever of these the job has:

- a ``DeviceMesh``: its root mesh's dimension names, mapped by ``DIMENSIONS`` (``dp_replicate``
  and ``dp_shard`` are both data parallelism: their indices are flattened into one); a name it
  does not know is kept as the job gave it;
- a ``torch.distributed.pipelining`` stage: its rank in the pipeline's group;
- DeepSpeed's pipeline grid (``engine.grid``) or its ``mpu`` (``watchers.deepspeed`` reads them);
- Megatron-core's ``parallel_state``, once initialised;
- the monitor's own ``parallel`` argument, which wins over all of them.

``LayoutWatch`` is a step extension: it looks at the end of the first step and again whenever a
mesh or a pipeline stage was made since (their constructors are wrapped once per process), and
tells the monitor (``extensions.place``) when what it finds changed. A mesh made after
``watch()`` is picked up; a layout that cannot be known is never guessed.
"""

from __future__ import annotations

import functools
import gc
import logging
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gpumon.wire import LABEL_LIMITS, MAX_WORLD_SIZE, PARALLEL_DIMS, ParallelLayout, is_label

if TYPE_CHECKING:
    from gpumon.client.core.seam import Watched

log = logging.getLogger("gpumon.client")

DIMENSIONS: dict[str, str] = {
    **dict.fromkeys(("dp", "data", "ddp", "fsdp", "dp_replicate", "dp_shard", "replicate",
                     "shard", "data_parallel", "hsdp"), "dp"),
    **dict.fromkeys(("tp", "tensor", "model", "mp", "tensor_parallel"), "tp"),
    **dict.fromkeys(("pp", "pipe", "pipeline", "pipeline_parallel"), "pp"),
    **dict.fromkeys(("ep", "expert", "moe", "expert_parallel"), "ep"),
    **dict.fromkeys(("cp", "context", "context_parallel"), "cp"),
}
"""A mesh dimension's name (lower case) -> the dimension of the layout it is."""

WRAPPED_MARK = "__gpumon_wrapped__"
MAX_MADE = 64
"""Meshes and pipeline stages remembered (a job makes a few; submeshes are sliced from them)."""
_made: list[weakref.ref[Any]] = []
"""Meshes and pipeline stages made since their constructors were wrapped, oldest first."""
_made_count = 0
_install_lock = threading.Lock()
_installed = False


def layout_of_mesh(mesh: Any) -> ParallelLayout | None:
    """The layout a ``DeviceMesh`` gives this rank (its root mesh's), or ``None``."""
    root = _root(mesh)
    names = getattr(root, "mesh_dim_names", None)
    coordinate = root.get_coordinate() if names else None
    if not names or coordinate is None:
        return None
    shape = tuple(root.mesh.shape)
    flat: dict[str, tuple[int, int]] = {}  # dimension -> (index, size), flattened in order
    other: list[tuple[str, int]] = []
    for name, index, size in zip(names, coordinate, shape, strict=True):
        dim = DIMENSIONS.get(str(name).lower())
        if dim is None:
            other.append((str(name), int(index)))
            continue
        before, before_size = flat.get(dim, (0, 1))
        flat[dim] = (before * int(size) + int(index), before_size * int(size))
    return _layout({dim: index for dim, (index, _) in flat.items()}, "mesh", other)


def layout_of_stage(stage: Any) -> ParallelLayout | None:
    """The layout a pipeline stage gives this rank: its rank in the pipeline's group."""
    index = getattr(stage, "group_rank", None)
    if index is None:
        index = getattr(stage, "stage_index", None)
    return ParallelLayout(pp=int(index), source="pipeline") if index is not None else None


def layout_of_deepspeed(engine: Any) -> ParallelLayout | None:
    """A DeepSpeed engine's place for this rank: its pipeline grid (``PipelineEngine.grid``,
    or the ``PipelineModule``'s own: stage, data-parallel rank, model-parallel slice), else
    its ``mpu``'s ranks."""
    grid = getattr(engine, "grid", None) or getattr(engine, "_grid", None)
    getters: dict[str, tuple[Any, str]] = {}
    if grid is not None and hasattr(grid, "get_pipe_parallel_rank"):
        getters = {"pp": (grid, "get_pipe_parallel_rank"), "dp": (grid, "get_data_parallel_rank"),
                   "tp": (grid, "get_slice_parallel_rank")}
    elif getattr(engine, "mpu", None) is not None:
        mpu = engine.mpu
        getters = {"dp": (mpu, "get_data_parallel_rank"),
                   "tp": (mpu, "get_tensor_model_parallel_rank"
                          if hasattr(mpu, "get_tensor_model_parallel_rank")
                          else "get_model_parallel_rank"),
                   "pp": (mpu, "get_pipeline_model_parallel_rank")}
    found = {}
    for dim, (owner, getter) in getters.items():
        function = getattr(owner, getter, None)
        if function is None:
            continue
        try:
            found[dim] = int(function())
        except Exception:  # a dimension this engine does not set up
            continue
    if grid is not None and found.get("tp") == 0 and getattr(grid, "slice_parallel_size", 1) == 1:
        del found["tp"]  # a grid without model parallelism: no tensor dimension
    return _layout(found, "deepspeed") if found else None


def layout_of_megatron() -> ParallelLayout | None:
    """Megatron-core's ``parallel_state``, where the job imported and initialised it."""
    state = sys.modules.get("megatron.core.parallel_state")
    if state is None or not state.model_parallel_is_initialized():
        return None
    getters = {"dp": "get_data_parallel_rank", "tp": "get_tensor_model_parallel_rank",
               "pp": "get_pipeline_model_parallel_rank", "ep": "get_expert_model_parallel_rank",
               "cp": "get_context_parallel_rank"}
    found = {}
    for dim, getter in getters.items():
        function = getattr(state, getter, None)
        if function is not None:
            try:
                found[dim] = int(function())
            except Exception:  # a dimension this version or job does not set up
                continue
    return _layout(found, "megatron") if found else None


def merge(layouts: Iterable[ParallelLayout | None]) -> ParallelLayout | None:
    """One layout from several, the first to name a dimension giving it; sources joined."""
    found = [layout for layout in layouts if layout is not None]
    if not found:
        return None
    values: dict[str, int] = {}
    sources: list[str] = []
    other: dict[str, int] = {}
    for layout in found:
        named = False
        for dim in PARALLEL_DIMS:
            value = getattr(layout, dim)
            if value is not None and dim not in values:
                values[dim], named = value, True
        for name, index in layout.other:
            if name not in other:
                other[name], named = index, True
        if named and layout.source and layout.source not in sources:
            sources.append(layout.source)
    return _layout(values, "/".join(sources) or None, sorted(other.items()))


def from_argument(parallel: Mapping[str, int]) -> ParallelLayout:
    """The monitor's ``parallel`` argument as a layout; ``ValueError`` if it is not one."""
    values: dict[str, int] = {}
    other: list[tuple[str, int]] = []
    for name, index in parallel.items():
        if not (isinstance(name, str) and is_label(name, LABEL_LIMITS["parallel"])):
            raise ValueError(f"parallel: {name!r} is not a dimension's name "
                             f"(1-{LABEL_LIMITS['parallel']} of [A-Za-z0-9_.:/-])")
        if type(index) is not int or not 0 <= index < MAX_WORLD_SIZE:
            raise ValueError(f"parallel[{name!r}]={index!r}: expected an index, an int from 0 "
                             f"below {MAX_WORLD_SIZE}")
        dim = DIMENSIONS.get(str(name).lower(), None)
        if dim is None or dim in values:
            other.append((str(name), index))
        else:
            values[dim] = index
    return _layout(values, "argument", other)


class LayoutWatch:
    """The step extension that finds the rank's layout (see the module docstring)."""

    def __init__(self, monitor: Watched) -> None:
        self._place = monitor.extensions.place
        self._sources: list[weakref.ref[Any]] = []
        self._known: ParallelLayout | None = None  # what a framework said outright
        self._looked_at = -1  # _made_count when last looked
        self._layout: ParallelLayout | None = None

    def know(self, layout: ParallelLayout) -> None:
        """A layout a framework's engine gives outright (DeepSpeed's grid)."""
        self._known = layout
        self._looked_at = -1

    def add_source(self, source: Any) -> None:
        """A mesh or stage found beside the model (made before the constructors were wrapped)."""
        try:
            self._sources.append(weakref.ref(source))
            self._looked_at = -1
        except TypeError:
            pass

    def step_begin(self) -> None:
        pass

    def step_end(self, fields: dict[str, object]) -> None:
        if self._looked_at == _made_count:
            return
        self._looked_at = _made_count
        sources = [ref() for ref in self._sources] + [ref() for ref in _made]
        meshes = [s for s in sources if s is not None and hasattr(s, "mesh_dim_names")]
        stages = [s for s in sources if s is not None and hasattr(s, "stage_index")]
        layout = merge([
            self._known,
            layout_of_megatron(),
            _largest(layout_of_mesh(m) for m in meshes),
            next((layout_of_stage(s) for s in stages), None),
        ])
        if layout is not None and layout != self._layout:
            self._layout = layout
            self._place(layout)


def watch_layout(monitor: Watched, model: Any) -> None:
    """Find ``model``'s rank's layout from now on: the meshes of its DTensor parameters, the
    pipeline stage that runs it, and any mesh or pipeline stage made later."""
    install_constructors()
    watch = monitor.extensions.attach(LayoutWatch, lambda: LayoutWatch(monitor))
    # A DeepSpeed PipelineEngine (watched as its engine) or the PipelineModule it runs
    # (what gpumon run meets: train_batch calls the module, never the engine).
    engine = layout_of_deepspeed(model) \
        if hasattr(model, "train_batch") or hasattr(model, "_grid") else None
    if engine is not None:
        watch.know(engine)
    parameters = getattr(model, "parameters", None)
    if parameters is None:
        return
    meshes = {}
    for parameter in parameters():
        mesh = getattr(parameter, "device_mesh", None)
        if mesh is not None:
            meshes[id(mesh)] = mesh
    for mesh in meshes.values():
        watch.add_source(_root(mesh))
    stage = _stage_running(model)
    if stage is not None:
        watch.add_source(stage)


def _stage_running(model: Any) -> Any:
    """The pipeline stage made before the constructors were wrapped that runs ``model`` (one
    pass over the objects the garbage collector tracks, once per model, and only in a process
    that imported ``torch.distributed.pipelining``)."""
    module = sys.modules.get("torch.distributed.pipelining.stage")
    cls = getattr(module, "_PipelineStageBase", None)
    if not isinstance(cls, type):
        return None
    for ref in _made:
        if getattr(ref(), "submod", None) is model:
            return ref()
    for obj in gc.get_objects():
        if isinstance(obj, weakref.ProxyTypes):  # a dead proxy raises on isinstance()
            continue
        if isinstance(obj, cls) and getattr(obj, "submod", None) is model:
            return obj
    return None


def install_constructors() -> None:
    """Wrap ``DeviceMesh`` and the pipeline stages' constructors once per process, where the
    job has imported them, so that what it makes later is found."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
        for module, name in (("torch.distributed.device_mesh", "DeviceMesh"),
                             ("torch.distributed.pipelining.stage", "_PipelineStageBase")):
            try:
                cls = getattr(__import__(module, fromlist=[name]), name)
            except Exception:  # not in this torch: nothing of the kind to find
                continue
            init = cls.__init__
            if not getattr(init, WRAPPED_MARK, False):
                cls.__init__ = _noting(init)


def _noting(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        global _made_count
        init(self, *args, **kwargs)
        try:
            _made[:] = [ref for ref in _made if ref() is not None][-(MAX_MADE - 1):]
            _made.append(weakref.ref(self))
            _made_count += 1
        except Exception:
            pass

    setattr(__init__, WRAPPED_MARK, True)
    return __init__


def _layout(values: Mapping[str, int], source: str | None,
            other: Iterable[tuple[str, int]] = ()) -> ParallelLayout:
    return ParallelLayout(dp=values.get("dp"), tp=values.get("tp"), pp=values.get("pp"),
                          ep=values.get("ep"), cp=values.get("cp"), source=source,
                          other=tuple(other))


def _root(mesh: Any) -> Any:
    get_root = getattr(mesh, "_get_root_mesh", None)
    try:
        return get_root() if get_root is not None else mesh
    except Exception:
        return mesh


def _largest(layouts: Iterable[ParallelLayout | None]) -> ParallelLayout | None:
    """The layout naming the most dimensions (a job's root mesh, not a submesh it sliced), the
    newest of those (``layouts`` oldest first) where several name as many."""
    found = [layout for layout in layouts if layout is not None]
    best: ParallelLayout | None = None
    for layout in found:
        if best is None or _named(layout) >= _named(best):
            best = layout
    return best


def _named(layout: ParallelLayout) -> int:
    return sum(getattr(layout, d) is not None for d in PARALLEL_DIMS) + len(layout.other)
