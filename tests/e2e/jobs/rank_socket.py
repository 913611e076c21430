"""Run ddp_job.py with each rank reporting to its own agent, as if every rank ran on a node of
its own: ``rank_socket.py --sockets S0,S1,... JOB_ARGS`` sets ``GPUMON_SOCKET`` to the socket
of this process' RANK, then runs the job with JOB_ARGS."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

JOB = Path(__file__).resolve().parent / "ddp_job.py"


def main() -> None:
    flag, sockets, *job_args = sys.argv[1:]
    assert flag == "--sockets", sys.argv
    os.environ["GPUMON_SOCKET"] = sockets.split(",")[int(os.environ["RANK"])]
    sys.argv = [str(JOB), *job_args]
    runpy.run_path(str(JOB), run_name="__main__")


if __name__ == "__main__":
    main()
