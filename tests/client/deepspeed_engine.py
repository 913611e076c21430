"""A one-rank DeepSpeed engine (``DS_ACCELERATOR=cpu``, gloo, world 1) driven through the cases
``watch(engine)`` must get right, each reported to an in-memory transport; prints what each
case sent as JSON. Run in a process of its own: it initialises ``torch.distributed``."""

from __future__ import annotations

from tests.client import deepspeed_world1  # noqa: F401  (first: the world, DeepSpeed set up)

# isort: split
import json
import sys
import time
from typing import Any

import deepspeed
import torch
from torch import nn

from gpumon.client import StepMonitor
from gpumon.client.core.transport import MemoryTransport
from gpumon.wire import StepRecord

deepspeed.init_distributed(dist_backend="gloo")
torch.set_num_threads(1)


def engine_for(stage: int, gas: int) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                      config=config)
    return engine


def sent(transport: MemoryTransport) -> list[dict[str, Any]]:
    return [{"step": r.step, "samples": r.samples, "phases": dict(r.phases_s),
             }
            for r in transport.records() if isinstance(r, StepRecord)]


def case(name: str, stage: int, gas: int, body: Any) -> dict[str, Any]:
    transport = MemoryTransport()
    mon = StepMonitor(run=name, transport=transport)
    engine = engine_for(stage, gas)
    mon.watch(engine)
    mon.watch(engine)  # twice: nothing wrapped twice
    extra = body(mon, engine) or {}
    mon.close()
    return {"steps": sent(transport), "errors": mon.stats.extension_errors, **extra}


def micro(engine: Any, batch: int = 4) -> torch.Tensor:
    loss = engine(torch.randn(batch, 32)).square().mean()
    engine.backward(loss)
    engine.step()
    return loss


def accumulate(mon: StepMonitor, engine: Any) -> None:
    for _ in range(3 * 4):  # three optimizer steps of four micro-batches of 4, the last of 3
        micro(engine, 4)
    micro(engine, 3)
    for _ in range(3):
        micro(engine, 4)


def user_steps(mon: StepMonitor, engine: Any) -> None:
    for _ in range(3):
        with mon.step(samples=8):
            micro(engine)
    micro(engine)  # outside any step of the loop's: not a step once the loop makes its own


def evaluation(mon: StepMonitor, engine: Any) -> dict[str, Any]:
    micro(engine)
    engine.eval()
    batch = torch.randn(200_000, 32)
    t0 = time.perf_counter()
    with torch.no_grad():
        engine(batch)
    eval_s = time.perf_counter() - t0
    engine.train()
    micro(engine)
    return {"eval_s": eval_s}


def failing(mon: StepMonitor, engine: Any) -> dict[str, Any]:
    micro(engine)
    try:
        engine(torch.randn(4, 7))  # the wrong width: the forward raises
    except RuntimeError:
        pass
    micro(engine)
    return {"wrapped": [getattr(engine, n).__wrapped__.__name__ for n in ("forward", "backward", "step")]}


def watched_inside_its_first_forward(mon: StepMonitor, engine: Any) -> None:
    for _ in range(3 * 2):  # three optimizer steps of two micro-batches of 4
        micro(engine)


def late_case(name: str) -> dict[str, Any]:
    """Watched from a forward pre-hook, on the first call, as ``gpumon run`` watches."""
    transport = MemoryTransport()
    mon = StepMonitor(run=name, transport=transport)
    engine = engine_for(0, 2)

    def watch_now(_module: Any, _args: Any) -> None:
        handle.remove()
        mon.watch(engine)

    handle = engine.register_forward_pre_hook(watch_now)
    watched_inside_its_first_forward(mon, engine)
    mon.close()
    return {"steps": sent(transport), "errors": mon.stats.extension_errors}


CASES = {
    "accumulation": (0, 4, accumulate),
    "accumulation-z2": (2, 4, accumulate),
    "user-steps": (1, 1, user_steps),
    "evaluation": (0, 1, evaluation),
    "failing": (0, 1, failing),
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES)
    result = {name: case(name, *CASES[name]) for name in names}
    result["late"] = late_case("late")
    print(json.dumps(result))
