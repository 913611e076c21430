"""A pipeline run made to measure: two stages of two data-parallel replicas each (rank r is
stage r // 2, replica r % 2), stage 1 doing more than twice stage 0's work while stage 0 waits
for it to receive, in the lines an agent records and the datagrams a hook sends; and the
report's table of such a run's ranks, read back from its page."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gpumon.wire import HelloRecord, ParallelLayout, to_wire

RUN = "gpt"
RANKS = 4
STEP_S = 0.4
T0 = 1_700_000_000.0
STAGES = {  # stage → (own work, exposed wait, of which the bubble), in shares of the step
    0: (0.4, 0.6, 0.5),  # waits for stage 1's activations and gradients
    1: (0.9, 0.1, 0.075),
}


def hello(rank: int) -> dict[str, object]:
    """The rank's hello with its layout, as the hook sends it and the agent records it."""
    return to_wire(HelloRecord(RUN, rank, world=RANKS, parallel=ParallelLayout(
        dp=rank % 2, pp=rank // 2, source="pipeline")))


def step(rank: int, number: int, t0: float = T0, step_s: float = STEP_S) -> dict[str, Any]:
    """One rank's step: its stage's own work in phases, the rest a wait to send and receive."""
    own, wait, bubble = (share * step_s for share in STAGES[rank // 2])
    return {"v": 1, "kind": "step", "run": RUN, "rank": rank, "world": RANKS,
            "local_rank": rank, "step": number, "t_start": t0 + number * step_s,
            "duration": step_s, "gpu": rank,
            "phases": {"data": 0.1 * own, "forward": 0.3 * own, "backward": 0.5 * own + wait,
                       "optimizer": 0.1 * own},
            "comm": {"exposed": wait, "busy": wait + 0.01, "bubble": bubble,
                     "ops": {"send": [8, 2**24, 0.01], "recv": [8, 2**24, wait]}},
            "samples": 8, "tokens": 8 * 2048}


def write(path: Path, steps: int = 80, hellos: bool = True) -> Path:
    """The recording: each rank's hello (unless not ``hellos``), then its steps."""
    lines = [hello(rank) for rank in range(RANKS)] if hellos else []
    lines += [step(rank, number) for number in range(steps) for rank in range(RANKS)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def table_rows(page: str) -> list[list[str]]:
    """The cells of each row of the page's parallelism table, header first."""
    table = page.split('<table id="parallelism">', 1)[1].split("</table>", 1)[0]
    return [[re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", tr)]
            for tr in re.findall(r"<tr>(.*?)</tr>", table)]
