"""Imported first by the one-rank DeepSpeed scripts (``deepspeed_engine.py``, ``deepspeed_hf.py``):
rank 0 of a world of one on 127.0.0.1 in the environment, DeepSpeed's CPU accelerator, and
DeepSpeed imported with its shared-memory all-reduce off. That op (C++, compiled at
``init_distributed``) serves ``inference_all_reduce`` alone, which training never calls: off,
so that no compiler runs here."""

from __future__ import annotations

import os
import socket

os.environ.setdefault("DS_ACCELERATOR", "cpu")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))

import deepspeed  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
