"""Point-to-point transfers between two ranks (gloo) with the communication tap watching, each
waited on as ``torch.distributed.pipelining`` does: run by ``torch.distributed.run
--nproc-per-node 2``; writes ``OUT/rank<R>.json``.

Per step (a ledger step each), after a barrier rank 0 works 50 ms then sends, and rank 1
receives at once, so rank 1 waits: a blocking ``send``/``recv``; ``isend``/``irecv`` and
``Work.wait``; a ``batch_isend_irecv`` both ways whose ``P2POp``s were made before the tap was
installed. Each rank times its own calls and waits (``own``), apart from gpumon.

    p2p_worker.py OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from time import perf_counter

import torch
import torch.distributed as dist

SIZE = 1024  # floats: 4,096 bytes


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    sent, received = torch.ones(SIZE), torch.zeros(SIZE)
    early = [dist.P2POp(dist.isend if rank == 0 else dist.irecv,
                        sent if rank == 0 else received, peer)]  # made before the tap
    from gpumon.client.comm.ledger import CommLedger
    from gpumon.client.comm.tap import tap_into

    ledger = CommLedger()
    assert tap_into(ledger)
    steps = []

    def step(send: object, receive: object) -> None:
        dist.barrier()
        fields: dict[str, object] = {}
        ledger.step_begin()
        start = perf_counter()
        if rank == 0:
            time.sleep(0.05)
            send()
            own = 0.0
        else:
            t0 = perf_counter()
            receive()
            own = perf_counter() - t0
        ledger.step_end(fields)
        steps.append({"comm": fields.get("comm"), "own": own, "step": perf_counter() - start})

    def batch() -> None:
        ops = early + [dist.P2POp(dist.irecv if rank == 0 else dist.isend,
                                  received if rank == 0 else sent, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    step(lambda: dist.send(sent, 1), lambda: dist.recv(received, 0))
    step(lambda: dist.isend(sent, 1).wait(), lambda: dist.irecv(received, 0).wait())
    step(batch, batch)
    dist.barrier()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(steps))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
