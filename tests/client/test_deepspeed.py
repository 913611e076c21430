"""``watch(engine)`` on a real one-rank DeepSpeed engine (CPU accelerator, gloo, world 1): the
steps it makes, their samples and phases, a loop that makes its own steps, evaluation between
steps, a forward that fails, an engine watched from inside its first forward, and a Hugging
Face ``Trainer`` with a ``deepspeed`` config through its callback. Each runs in a process of its
own (``deepspeed_engine.py``, ``deepspeed_hf.py``), which initialises ``torch.distributed``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT

SCRIPT = Path(__file__).with_name("deepspeed_engine.py")
HF_SCRIPT = Path(__file__).with_name("deepspeed_hf.py")
PHASES = {"forward", "backward", "optimizer"}


@pytest.fixture(scope="module")
def cases() -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("name", ["accumulation", "accumulation-z2"])
def test_a_step_is_one_optimizer_step_with_its_micro_batches(cases: dict[str, Any], name: str) -> None:
    steps = cases[name]["steps"]
    # Sixteen micro-batches at four a step: four steps, the third micro-batch of the fourth
    # step three samples short.
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert [s["samples"] for s in steps] == [16, 16, 16, 15]
    assert all(set(s["phases"]) == PHASES and min(s["phases"].values()) > 0 for s in steps)
    assert cases[name]["errors"] == 0


def test_a_loop_that_makes_its_own_steps_keeps_them(cases: dict[str, Any]) -> None:
    steps = cases["user-steps"]["steps"]
    # Its three steps with the samples it gave; the engine's phases inside; the iteration it
    # ran outside any step of its own is no step.
    assert [(s["step"], s["samples"]) for s in steps] == [(0, 8), (1, 8), (2, 8)]
    assert all(set(s["phases"]) == PHASES for s in steps)


def test_evaluation_between_steps_is_in_no_step(cases: dict[str, Any]) -> None:
    steps = cases["evaluation"]["steps"]
    assert [s["samples"] for s in steps] == [4, 4]
    # The evaluation's forward (a batch of 200,000) is not added to the next step's (of 4).
    assert steps[1]["phases"]["forward"] < cases["evaluation"]["eval_s"] / 4


def test_an_engine_watched_inside_its_first_forward_starts_at_its_backward(cases: dict[str, Any]) -> None:
    # Three optimizer steps of two micro-batches of 4: the first micro-batch's forward ran
    # before watch(), its backward opens the first step (counted at the configured 4).
    steps = cases["late"]["steps"]
    assert [(s["step"], s["samples"]) for s in steps] == [(0, 8), (1, 8), (2, 8)]
    assert all(set(s["phases"]) == PHASES for s in steps)


def test_a_failed_forward_loses_its_step_and_nothing_else(cases: dict[str, Any]) -> None:
    failing = cases["failing"]
    assert [s["step"] for s in failing["steps"]] == [0, 1]
    assert failing["errors"] == 0
    # Watched twice, each method is wrapped once: under the wrapper, DeepSpeed's own.
    assert failing["wrapped"] == ["wrapped_fn", "wrapped_fn", "step"]


def test_a_trainer_with_a_deepspeed_config_reports_through_its_callback() -> None:
    # The callback makes the steps (one per optimizer step, its samples counted from the
    # model's input); the engine's watcher times forward, backward and optimizer inside them.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(HF_SCRIPT)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["engine"] == "DeepSpeedEngine"
    steps = result["steps"]
    assert [(s["step"], s["samples"]) for s in steps] == [(0, 8), (1, 8), (2, 8)]
    assert all(min(s["phases"].get(p, 0) for p in PHASES) > 0 for s in steps), steps
