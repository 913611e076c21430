"""``gpumon run``: start an unmodified training command with gpumon's hooks in its processes.

The command replaces ``gpumon run`` (``exec``): it keeps the process id, process group,
terminal, standard streams and signals ``gpumon run`` had, so Ctrl-C, a ``SIGTERM`` sent to
that process id and the exit status are the job's own, exactly as if it had been started
directly. What changes is its environment: ``PYTHONPATH`` is led by the folder whose
``sitecustomize`` loads the hooks into every Python process the job starts (``gpumon.client.
autowatch``; the user's ``PYTHONPATH`` and ``sitecustomize`` still follow), ``GPUMON_RUN``
names the run (its job's name where a scheduler gives one: ``gpumon.client.core.run_name``) and,
with ``--socket``, ``GPUMON_SOCKET`` says where the agent is. One line on stderr says so.
With ``GPUMON_RUN_DISABLE=1`` the command is started untouched and nothing is printed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpumon.client.autowatch import DISABLE_ENV, SHIM_DIR
from gpumon.client.core.identity import resolve_socket_path
from gpumon.client.core.run_name import resolve_run_name
from gpumon.errors import GpumonError
from gpumon.wire import MAX_RUN_CHARS, is_label

EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
"""Exit statuses when the command cannot be started, as a POSIX shell gives them."""


class RunError(GpumonError):
    """The command cannot be started; ``exit_code`` says why (2: bad input)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def job_environment(env: Mapping[str, str], run: str | None, socket: str | None,
                    command: Sequence[str]) -> tuple[dict[str, str], str, str]:
    """The job's environment, its run name (``run_name``'s order: the job's own name before
    the script's) and the socket it reports to."""
    name, _ = resolve_run_name(env, command, run)
    if not is_label(name, MAX_RUN_CHARS):
        raise RunError(f"run name {name!r}: use 1-{MAX_RUN_CHARS} of letters, digits, _ . : / -", 2)
    job = dict(env)
    job["GPUMON_RUN"] = name
    if socket is not None:
        job["GPUMON_SOCKET"] = socket
    path = resolve_socket_path(None, job)
    theirs = env.get("PYTHONPATH")
    job["PYTHONPATH"] = str(SHIM_DIR) + (os.pathsep + theirs if theirs else "")
    return job, name, path


def watching_line(name: str, socket_path: str) -> str:
    """The one line ``gpumon run`` prints on stderr."""
    there = "" if Path(socket_path).exists() else "; no agent there now, steps are dropped until one starts"
    return f"gpumon: watching run {name!r}, steps to {socket_path}{there} (GPUMON_RUN_DISABLE=1 to turn off)"


def run_command(command: Sequence[str], run: str | None = None, socket: str | None = None) -> None:
    """Replace this process with ``command``, watched; returns only by raising ``RunError``."""
    if not command:
        raise RunError("give the command to run after --, e.g. gpumon run -- python train.py", 2)
    if os.environ.get(DISABLE_ENV) == "1":
        env = dict(os.environ)
    else:
        env, name, path = job_environment(os.environ, run, socket, command)
        print(watching_line(name, path), file=sys.stderr, flush=True)
    sys.stdout.flush()
    try:
        os.execvpe(command[0], list(command), env)
    except FileNotFoundError:
        raise RunError(f"{command[0]}: command not found", EXIT_NOT_FOUND) from None
    except PermissionError:
        raise RunError(f"{command[0]}: permission denied", EXIT_NOT_EXECUTABLE) from None
    except OSError as exc:
        raise RunError(f"{command[0]}: {exc.strerror or exc}", EXIT_NOT_EXECUTABLE) from None
