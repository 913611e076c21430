"""What the communication tap wraps: one row per function, and how each names its payload.

Three kinds, each wrapped by its own module of this room:

- ``torch.distributed``'s collectives, blocking or ``async_op=True`` (``tap``): DDP's comm
  hooks, FSDP, DeepSpeed and user code call them.
- its point-to-point transfers (``tap``): ``send`` and ``recv`` block, ``isend`` and ``irecv``
  return a ``Work`` the caller waits on, and ``batch_isend_irecv`` launches a list of
  ``P2POp``s at once, as ``torch.distributed.pipelining`` and DeepSpeed's pipeline engine do.
- the functional collectives (``functional``), which return a tensor that is waited on when
  first used (``wait_tensor``): DTensor, tensor and sequence parallelism, async TP.

A row's ``op`` is the name a step's ``comm`` reports it under; a payload is the argument at
``position`` or named ``keyword`` (``-1``: none). Whose bytes count follows nccl-tests: an
all-gather's output, a reduce-scatter's input, every other kind's one buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

C10D = "torch.distributed.distributed_c10d"
FUNCTIONAL = "torch.distributed._functional_collectives"


@dataclass(frozen=True, slots=True)
class Tapped:
    """One wrapped function."""

    module: str
    function: str
    op: str
    """The kind it is reported as (``send``/``recv`` for point to point)."""
    position: int
    keyword: str
    output: bool = False
    """Its bytes are those of what it returns (a functional all-gather's gathered tensor)."""


TAPPED: tuple[Tapped, ...] = (
    # collectives
    Tapped(C10D, "all_reduce", "all_reduce", 0, "tensor"),
    Tapped(C10D, "all_reduce_coalesced", "all_reduce", 0, "tensors"),
    Tapped(C10D, "broadcast", "broadcast", 0, "tensor"),
    Tapped(C10D, "reduce", "reduce", 0, "tensor"),
    Tapped(C10D, "all_gather", "all_gather", 0, "tensor_list"),
    Tapped(C10D, "all_gather_into_tensor", "all_gather", 0, "output_tensor"),
    Tapped(C10D, "all_gather_single", "all_gather", 0, "output_tensor"),
    Tapped(C10D, "_all_gather_base", "all_gather", 0, "output_tensor"),
    Tapped(C10D, "reduce_scatter", "reduce_scatter", 1, "input_list"),
    Tapped(C10D, "reduce_scatter_tensor", "reduce_scatter", 1, "input"),
    Tapped(C10D, "reduce_scatter_single", "reduce_scatter", 1, "input"),
    Tapped(C10D, "_reduce_scatter_base", "reduce_scatter", 1, "input"),
    Tapped(C10D, "all_to_all", "all_to_all", 1, "input_tensor_list"),
    Tapped(C10D, "all_to_all_single", "all_to_all", 1, "input"),
    Tapped(C10D, "gather", "gather", 0, "tensor"),
    Tapped(C10D, "scatter", "scatter", 0, "tensor"),
    Tapped(C10D, "barrier", "barrier", -1, ""),
    # point to point
    Tapped(C10D, "send", "send", 0, "tensor"),
    Tapped(C10D, "recv", "recv", 0, "tensor"),
    Tapped(C10D, "isend", "send", 0, "tensor"),
    Tapped(C10D, "irecv", "recv", 0, "tensor"),
    Tapped(C10D, "batch_isend_irecv", "p2p", 0, "p2p_op_list"),
    # functional collectives (DTensor and what is built on it)
    Tapped(FUNCTIONAL, "all_reduce", "all_reduce", 0, "self"),
    Tapped(FUNCTIONAL, "all_reduce_coalesced", "all_reduce", 0, "self"),
    Tapped(FUNCTIONAL, "broadcast", "broadcast", 0, "self"),
    Tapped(FUNCTIONAL, "all_gather_tensor", "all_gather", 0, "self", output=True),
    Tapped(FUNCTIONAL, "all_gather_tensor_autograd", "all_gather", 0, "self", output=True),
    Tapped(FUNCTIONAL, "all_gather_single", "all_gather", 0, "self", output=True),
    Tapped(FUNCTIONAL, "all_gather_into_tensor_coalesced", "all_gather", 0, "self",
           output=True),
    Tapped(FUNCTIONAL, "reduce_scatter_tensor", "reduce_scatter", 0, "self"),
    Tapped(FUNCTIONAL, "reduce_scatter_tensor_autograd", "reduce_scatter", 0, "self"),
    Tapped(FUNCTIONAL, "reduce_scatter_single", "reduce_scatter", 0, "self"),
    Tapped(FUNCTIONAL, "reduce_scatter_tensor_coalesced", "reduce_scatter", 0, "inputs"),
    Tapped(FUNCTIONAL, "all_to_all_single", "all_to_all", 0, "self"),
    Tapped(FUNCTIONAL, "all_to_all_single_autograd", "all_to_all", 0, "self"),
)
"""Every function the tap wraps, where this torch has it (a row it lacks is not measured)."""

RECEIVES = frozenset({"recv"})
"""The kinds whose exposed wait is a pipeline stage's bubble."""


def rows(module: str) -> tuple[Tapped, ...]:
    """The rows of one module."""
    return tuple(row for row in TAPPED if row.module == module)
