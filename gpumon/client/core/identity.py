"""Who a training process is: run name, rank, world size, local rank, and where the agent is."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpumon.client.core.run_name import resolve_run_name
from gpumon.wire import MAX_RUN_CHARS, is_label

DEFAULT_SOCKET = "/run/gpumon/ingest.sock"

# Launchers' variables, in order of preference: torchrun/torch.distributed, then Slurm.
_ENV_SOURCES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


@dataclass(frozen=True, slots=True)
class Identity:
    """The labels a rank reports under."""

    run: str
    rank: int
    world: int | None
    local_rank: int | None


def resolve_identity(
    run: str | None = None,
    rank: int | None = None,
    world: int | None = None,
    local_rank: int | None = None,
    env: Mapping[str, str] | None = None,
    argv: Sequence[str] | None = None,
) -> Identity:
    """Fill what the caller did not give from torch.distributed, the environment, or defaults.

    Rank and world come from an initialised ``torch.distributed`` process group, else
    ``RANK``/``WORLD_SIZE``, else ``SLURM_PROCID``/``SLURM_NTASKS``, else 0 and 1 (a world
    stays unknown when only a rank is known). Local rank comes from ``LOCAL_RANK``, else
    ``SLURM_LOCALID``, else 0 for a single process (unknown otherwise). The run comes from
    ``GPUMON_RUN``, else the job the process runs in, else its script (``run_name``; the
    script from ``argv``, by default ``sys.argv`` when ``env`` is the process's own). Raises
    ``ValueError`` for an invalid run name or inconsistent ranks, naming where they came from.
    """
    if argv is None:
        argv = sys.argv[:1] if env is None else ()
    env = os.environ if env is None else env
    run, run_source = resolve_run_name(env, argv, run)
    if not is_label(run, MAX_RUN_CHARS):
        raise ValueError(
            f"{run_source}={run!r}: a run name is 1-{MAX_RUN_CHARS} characters of "
            "letters, digits and _ . : / -"
        )
    found_rank, found_world = _distributed_rank_world()
    if found_rank is None:
        for rank_var, world_var, _ in _ENV_SOURCES:
            if rank_var in env:
                found_rank = _env_int(env, rank_var)
                found_world = _env_int(env, world_var) if world_var in env else None
                break
    if local_rank is None:
        for _, _, local_var in _ENV_SOURCES:
            if local_var in env:
                local_rank = _env_int(env, local_var)
                break
    rank = found_rank if rank is None else rank
    world = found_world if world is None else world
    if rank is None:
        rank = 0
        world = 1 if world is None else world
    if local_rank is None and world == 1:
        local_rank = 0
    if (
        rank < 0
        or (world is not None and not 0 <= rank < world)
        or (local_rank is not None and (local_rank < 0 or (world and local_rank >= world)))
    ):
        raise ValueError(f"rank {rank}, local rank {local_rank} do not fit world size {world}")
    return Identity(run=run, rank=rank, world=world, local_rank=local_rank)


def resolve_socket_path(path: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The agent's ingest socket: the argument, else ``GPUMON_SOCKET``, else the default."""
    env = os.environ if env is None else env
    return path or env.get("GPUMON_SOCKET") or DEFAULT_SOCKET


def _distributed_rank_world() -> tuple[int | None, int | None]:
    # Only look at torch.distributed if the training code already imported it.
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except (RuntimeError, ValueError):
        pass
    return None, None


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None
