"""A run's default name: the order of precedence shared by the hook and ``gpumon run``."""

from __future__ import annotations

import pytest

from gpumon.client.core.identity import resolve_identity
from gpumon.client.core.run_name import resolve_run_name, script_name
from gpumon.commands.run import job_environment

SLURM = {"SLURM_JOB_ID": "4242"}
ARRAY = {"SLURM_JOB_ID": "4250", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "7"}
K8S = {"GPUMON_K8S_NAMESPACE": "training", "GPUMON_K8S_JOB": "llama-sft-0",
       "GPUMON_K8S_POD": "llama-sft-0-x7k2p"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "sweep-3"}
COMMAND = ["torchrun", "--nproc-per-node", "2", "train.py"]


@pytest.mark.parametrize(
    ("given", "env", "expected"),
    [
        ("mine", {"GPUMON_RUN": "env", **SLURM, **TORCHRUN}, ("mine", "run")),
        (None, {"GPUMON_RUN": "env", **SLURM, **K8S, **TORCHRUN}, ("env", "GPUMON_RUN")),
        (None, {**SLURM, **K8S, **TORCHRUN}, ("slurm-4242", "SLURM_JOB_ID")),
        (None, ARRAY, ("slurm-4242_7", "SLURM_ARRAY_JOB_ID")),
        (None, {**K8S, **TORCHRUN}, ("training/llama-sft-0", "GPUMON_K8S_JOB")),
        # the outermost owner wins: a JobSet's pods also carry their Job's label
        (None, {**K8S, "GPUMON_K8S_JOBSET": "big-run"}, ("training/big-run", "GPUMON_K8S_JOBSET")),
        (None, {**K8S, "GPUMON_K8S_PYTORCHJOB": "ptj"}, ("training/ptj", "GPUMON_K8S_PYTORCHJOB")),
        # a label the pod does not carry comes through the Downward API empty: the pod names it
        (None, {**K8S, "GPUMON_K8S_JOB": ""}, ("training/llama-sft-0-x7k2p", "GPUMON_K8S_POD")),
        (None, {"GPUMON_K8S_POD": "p"}, ("p", "GPUMON_K8S_POD")),
        (None, TORCHRUN, ("sweep-3", "TORCHELASTIC_RUN_ID")),
        (None, {}, ("train", "script")),
    ],
)
def test_the_order_of_precedence(given: str | None, env: dict[str, str],
                                 expected: tuple[str, str]) -> None:
    assert resolve_run_name(env, COMMAND, given) == expected


@pytest.mark.parametrize("rdzv_id", ["none", "", "00829c90-a8dd-4c46-91ec-df5543181bad"])
def test_torchruns_defaults_name_nothing(rdzv_id: str) -> None:
    """``none`` is ``--rdzv-id``'s default; a UUID is what torchrun draws for a single-node or
    ``--standalone`` job (torch/distributed/run.py), different at every launch."""
    assert resolve_run_name({"TORCHELASTIC_RUN_ID": rdzv_id}, COMMAND) == ("train", "script")
    assert resolve_run_name({}, ["torchrun", f"--rdzv-id={rdzv_id}", "t.py"]) == ("t", "script")


def test_a_rendezvous_id_on_the_command_line_names_the_run() -> None:
    """``gpumon run`` names the run before torchrun starts its workers: it reads the flag."""
    assert resolve_run_name({}, ["torchrun", "--rdzv-id", "exp-9", "t.py"]) == ("exp-9", "--rdzv-id")
    assert resolve_run_name({}, ["torchrun", "--rdzv_id=exp 9", "t.py"]) == ("exp_9", "--rdzv_id")
    assert resolve_run_name({"PET_RDZV_ID": "exp-10"}, ["torchrun", "t.py"])[0] == "exp-10"


def test_names_are_made_valid_labels() -> None:
    name, _ = resolve_run_name({"GPUMON_K8S_WORKLOAD": "x" * 300}, [])
    assert name == "x" * 128
    assert resolve_run_name({"SLURM_JOB_ID": "12 34"}, [])[0] == "slurm-12_34"


def test_the_hooks_script_is_its_argv0() -> None:
    assert script_name(["/jobs/train.py", "--config", "cfg.py"]) == "train"
    assert script_name(["/site-packages/pkg/__main__.py"]) == "pkg"
    assert script_name(["-c"]) == script_name([""]) == script_name([]) == "default"


def test_hook_and_gpumon_run_agree() -> None:
    for env in (SLURM, ARRAY, K8S, TORCHRUN, {}):
        hooked = resolve_identity(env=env, argv=["/jobs/train.py"]).run
        _, launched, _ = job_environment(env, None, None, ["python", "/jobs/train.py"])
        assert hooked == launched
    # gpumon run sets GPUMON_RUN for its processes: the hook then keeps the launcher's name
    env, name, _ = job_environment(K8S, None, None, COMMAND)
    assert resolve_identity(env={**env, "GPUMON_K8S_JOB": "other"}).run == name
