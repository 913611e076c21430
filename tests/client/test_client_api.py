"""The client's public surface and identity resolution (its import footprint: tests/test_layering.py)."""

from __future__ import annotations

import sys

import pytest

import gpumon.client
from gpumon.client.core.identity import DEFAULT_SOCKET, Identity, resolve_identity, resolve_socket_path


def test_public_api_is_exactly_the_monitor_and_its_stats() -> None:
    assert gpumon.client.__all__ == ["ClientStats", "StepMonitor"]
    for name in gpumon.client.__all__:
        assert getattr(gpumon.client, name).__doc__


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, Identity("default", 0, 1, 0)),
        ({"GPUMON_RUN": "from-env"}, Identity("from-env", 0, 1, 0)),
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, Identity("default", 3, 8, 1)),
        ({"RANK": "3", "WORLD_SIZE": "8"}, Identity("default", 3, 8, None)),
        ({"RANK": "3"}, Identity("default", 3, None, None)),
        (
            {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"},
            Identity("default", 5, 16, 1),
        ),
        # torchrun's variables win over Slurm's when both are set
        (
            {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
            Identity("default", 2, 4, 2),
        ),
    ],
)
def test_identity_from_environment(env: dict[str, str], expected: Identity) -> None:
    assert resolve_identity(env=env) == expected


def test_arguments_win_over_environment() -> None:
    env = {"GPUMON_RUN": "env-run", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    got = resolve_identity(run="arg-run", rank=0, world=4, local_rank=0, env=env)
    assert got == Identity("arg-run", 0, 4, 0)


def test_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMON_RUN", "job-7")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("GPUMON_SOCKET", "/tmp/elsewhere.sock")
    assert resolve_identity() == Identity("job-7", 1, 2, 1)
    assert resolve_socket_path() == "/tmp/elsewhere.sock"
    assert resolve_socket_path("/x.sock") == "/x.sock"
    monkeypatch.delenv("GPUMON_SOCKET")
    assert resolve_socket_path() == DEFAULT_SOCKET


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        ({"run": "my run"}, {}, "run='my run'"),
        ({}, {"GPUMON_RUN": "x" * 129}, "GPUMON_RUN="),
        ({}, {"RANK": "zero"}, "RANK='zero'"),
        ({}, {"RANK": "4", "WORLD_SIZE": "4"}, "do not fit"),
        ({"rank": -1}, {}, "do not fit"),
        ({}, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "do not fit"),
    ],
)
def test_bad_identity_is_a_clear_error(kwargs: dict[str, object], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        resolve_identity(env=env, **kwargs)  # type: ignore[arg-type]


def test_initialised_torch_distributed_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeDist:
        def is_available(self) -> bool:
            return True

        def is_initialized(self) -> bool:
            return True

        def get_rank(self) -> int:
            return 6

        def get_world_size(self) -> int:
            return 7

    monkeypatch.setitem(sys.modules, "torch.distributed", FakeDist())
    assert resolve_identity(env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}) == Identity(
        "default", 6, 7, 0
    )
