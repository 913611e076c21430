"""Watching an unmodified training job: what ``gpumon run`` loads into each of its processes.

``gpumon run`` puts ``SHIM_DIR`` first on the job's ``PYTHONPATH``; the ``sitecustomize`` there is
loaded by every Python process the job starts (launchers, ranks, spawned children all inherit
the environment), waits for torch to be imported and then installs ``hooks``, which turn the
optimizer steps, DataLoader waits, forwards and backwards the training thread goes through into
steps and phases (``steps``). Nothing here imports torch before the job does.
"""

from __future__ import annotations

from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "shim"
"""The folder whose ``sitecustomize`` loads the hooks."""

DISABLE_ENV = "GPUMON_RUN_DISABLE"
"""Set to ``1``, the job runs untouched."""
