"""A run's name when nobody gave one: the job the process belongs to, as its scheduler names it.

Two jobs on one node that run the same script must not report under one name, or the agent
would see two processes claim each rank. So the script's name is the last resort; before it
come the names a scheduler already gives every job, in this order (the first found wins):

1. ``--run`` (``gpumon run``) or ``run=`` (``StepMonitor``), then ``GPUMON_RUN``;
2. the scheduler's job: Slurm's ``SLURM_JOB_ID`` (``slurm-1234``; an array task is
   ``slurm-1234_7``, from ``SLURM_ARRAY_JOB_ID`` and ``SLURM_ARRAY_TASK_ID``), else on
   Kubernetes the workload that owns the pod, from the variables the Downward API sets
   (``K8S_VARIABLES``, outermost owner first: a JobSet, a PyTorchJob, a Job, else the pod),
   prefixed by ``GPUMON_K8S_NAMESPACE`` when it is set (``training/llama-sft``);
3. torchrun's rendezvous id, where the user chose one (``--rdzv-id``; in the workers
   ``TORCHELASTIC_RUN_ID``). torchrun's default, ``none``, and the random UUID it draws for
   a single-node or ``--standalone`` job name nothing and are skipped;
4. the script's name (``train.py`` → ``train``), else the module run with ``-m``, else the
   program's name.

``gpumon run`` and the hook both call ``resolve_run_name``: ``gpumon run`` with the command it
starts (a rendezvous id given on that command line counts), the hook with ``sys.argv``.
Every name is made a valid run label (other characters become ``_``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpumon.wire import MAX_RUN_CHARS

DEFAULT_RUN = "default"
"""The name when nothing else names the run (``python -c``, an interactive session)."""

K8S_NAMESPACE = "GPUMON_K8S_NAMESPACE"
K8S_VARIABLES = (
    "GPUMON_K8S_WORKLOAD",  # whatever the pod spec says owns it
    "GPUMON_K8S_JOBSET",  # label jobset.sigs.k8s.io/jobset-name
    "GPUMON_K8S_PYTORCHJOB",  # label training.kubeflow.org/job-name
    "GPUMON_K8S_JOB",  # label batch.kubernetes.io/job-name
    "GPUMON_K8S_POD",  # metadata.name: the pod itself
)
"""Where a pod's owner is read, first found first: the Downward API sets them in the pod
spec (``fieldRef``); a label the pod does not carry gives an empty value, which is skipped."""

_UNSET_RDZV_IDS = frozenset({"", "none"})
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_RDZV_FLAGS = ("--rdzv-id", "--rdzv_id")


def resolve_run_name(env: Mapping[str, str], command: Sequence[str],
                     given: str | None = None) -> tuple[str, str]:
    """(run name, where it came from) by the order above. ``command`` is what runs: the
    launcher's command line (``gpumon run``) or the process's ``sys.argv`` (the hook)."""
    if given is not None:
        return given, "run"
    if env.get("GPUMON_RUN"):
        return env["GPUMON_RUN"], "GPUMON_RUN"
    found = scheduler_job(env) or rendezvous_id(env, command)
    if found is not None:
        name, source = found
        return _label(name), source
    return script_name(command), "script"


def scheduler_job(env: Mapping[str, str]) -> tuple[str, str] | None:
    """The Slurm job, else the Kubernetes workload, the process runs in, or None."""
    array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"slurm-{array_job}_{task}", "SLURM_ARRAY_JOB_ID"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}", "SLURM_JOB_ID"
    for var in K8S_VARIABLES:
        if env.get(var):
            namespace = env.get(K8S_NAMESPACE)
            return (f"{namespace}/{env[var]}" if namespace else env[var]), var
    return None


def rendezvous_id(env: Mapping[str, str], command: Sequence[str]) -> tuple[str, str] | None:
    """torchrun's rendezvous id when the user set one: on ``command`` (``--rdzv-id X``,
    ``--rdzv-id=X``), else in torchrun's own variable for it (``PET_RDZV_ID``) or the one it
    gives its workers (``TORCHELASTIC_RUN_ID``); None for its defaults."""
    for i, arg in enumerate(command):
        for flag in _RDZV_FLAGS:
            if arg == flag and i + 1 < len(command):
                return _chosen(command[i + 1], flag)
            if arg.startswith(flag + "="):
                return _chosen(arg.split("=", 1)[1], flag)
    for var in ("PET_RDZV_ID", "TORCHELASTIC_RUN_ID"):
        if var in env:
            return _chosen(env[var], var)
    return None


def script_name(command: Sequence[str]) -> str:
    """The command's script (``train.py`` → ``train``; a package's ``__main__.py`` → the
    package), else the module it runs (``-m pkg.train``), else the program's name; made a
    valid label, ``"default"`` when nothing is left."""
    if not command:
        return DEFAULT_RUN
    first = Path(command[0])
    if command[0].endswith(".py"):  # sys.argv of a script: the script comes first
        return _label(first.parent.name if first.stem == "__main__" else first.stem)
    module = next((command[i + 1] for i in range(len(command) - 1) if command[i] == "-m"), None)
    script = next((arg for arg in command[1:] if arg.endswith(".py") and not arg.startswith("-")),
                  None)
    if script is not None:
        return _label(Path(script).stem)
    if module is not None:
        return _label(module)
    return _label(first.name) if not command[0].startswith("-") else DEFAULT_RUN


def _chosen(value: str, source: str) -> tuple[str, str] | None:
    if value.strip().lower() in _UNSET_RDZV_IDS or _UUID.fullmatch(value.lower()):
        return None
    return value, source


def _label(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:/-]", "_", name)[:MAX_RUN_CHARS] or DEFAULT_RUN
