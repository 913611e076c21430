"""`gpumon top`'s memory view: the selected rank's breakdown, its ZeRO projection, the named
component."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from gpumon.analysis.memory import REMEDIES
from gpumon.commands.memory_view import parse_rank, select_rank
from gpumon.commands.top import render

GIB = 1024**3


def rank(n: int, risk: float, breakdown: dict[str, int] | None) -> dict[str, Any]:
    return {"run": "llm", "rank": n, "world": 2, "steps_total": 10,
            "memory_breakdown": breakdown,
            "analysis": {"gpu": 0, "bottleneck": "compute", "flags": [],
                         "oom": {"risk_ratio": risk},
                         "memory": {"component": "activations", "cause": "growing",
                                    "bytes": 3 * GIB, "remedy": REMEDIES["activations"]}}}


BREAKDOWN = {"parameters": 2 * GIB, "gradients": 2 * GIB, "optimizer_states": 4 * GIB,
             "activations": 6 * GIB, "other": GIB}
SNAPSHOT: dict[str, Any] = {
    "version": "0.1.0", "t": 1_800_000_000.0, "nvml": {"up": True},
    "gpus": [{"index": 0, "uuid": "GPU-0", "model": "NVIDIA H100 80GB HBM3",
              "memory_total_bytes": 80 * GIB}],
    "ranks": [rank(0, 0.2, BREAKDOWN), rank(1, 0.9, {**BREAKDOWN, "other": 9 * GIB}),
              rank(2, 0.95, None)],
}


def text(snapshot: dict[str, Any], selected: str | None = None) -> str:
    console = Console(width=160, record=True, color_system=None)
    console.print(render(snapshot, rank=selected))
    return console.export_text()


def test_the_riskiest_rank_with_a_breakdown_is_shown_by_default() -> None:
    out = text(SNAPSHOT)
    assert "Memory of llm rank 1" in out  # rank 2 is riskier but sends no breakdown
    assert "optimizer states" in out and "activations" in out
    assert "9.00" in out  # rank 1's other
    assert "total" in out and "23.00" in out
    assert "GPU capacity" in out and "80.0" in out
    # ZeRO over the run's 2 GPUs: Z1 = 2 + 2 + 4/2 + 6 + 9 = 21; over 8: Z3 = 8/8 + 15 = 16.
    assert "ZeRO on 2 GPUs" in out and "Z1 21.00" in out
    assert "ZeRO on 8 GPUs" in out and "Z3 16.00" in out
    assert f"activations growing: {REMEDIES['activations']}" in " ".join(out.split())


def test_a_selected_rank_is_shown() -> None:
    out = text(SNAPSHOT, "llm:0")
    assert "Memory of llm rank 0" in out and "Z1 13.00" in out
    assert "Memory of llm rank 0" in text(SNAPSHOT, "0")
    out = text(SNAPSHOT, "llm:2")
    assert "Memory of" not in out and "rank llm:2: no memory breakdown" in out


def test_no_breakdown_anywhere_shows_nothing() -> None:
    snapshot = {**SNAPSHOT, "ranks": [rank(0, 0.5, None)]}
    assert select_rank(snapshot["ranks"], None) is None
    assert "Memory of" not in text(snapshot)


@pytest.mark.parametrize("bad", ["llm:", "llm:x", "", "a:b:"])
def test_parse_rank_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_rank(bad)
    assert parse_rank("llm:3") == "llm:3"
