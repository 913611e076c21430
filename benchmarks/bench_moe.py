"""What counting each MoE layer's expert load costs a training step (docs/moe.md).

    python benchmarks/bench_moe.py [--rounds 10] [--block-steps 8] [--control]

One process, one intra-op thread, two identical tiny Mixtrals (Hugging Face
``MixtralForCausalLM``: 4 layers, 8 experts, top-2, hidden 64, batch 4 x 32 tokens), each
trained with AdamW inside the steps of its own ``StepMonitor``, reporting to a real Unix
datagram socket drained by a reader process. One model's MoE layers are watched (the experts'
hooks counting the router's top-k into the step's ``moe`` field); the other's are not: the
difference is the expert-load counting alone, the monitor's own step cost being on both sides.
Blocks of steps alternate between them, the order flipping every round, so both see the same
machine; the figure is the median over rounds of the time per step watched / plain - 1.
``--control`` watches neither: the figure it reads is what this machine reads for no
difference.

The alternating ratio moves by several per cent between rounds on a shared machine, more than
the counting costs, so the benchmark also times the counting itself, in the same run: one
layer's hook (``count_indices`` of a forward's top-k), and a whole step's (each layer's hook,
the step's end and the window's update, which the sender thread does in a watched job), over
the plain step's median.

Prints a line per round and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from time import perf_counter
from typing import Any

HERE = Path(__file__).resolve().parent


class Arm:
    """One model, its optimizer and its monitor, the MoE layers counted or not."""

    def __init__(self, socket_path: str, run: str, counted: bool) -> None:
        import torch
        import transformers

        from gpumon.client import StepMonitor
        from gpumon.client.watchers.moe import watch_experts

        torch.manual_seed(0)
        config = transformers.MixtralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
            num_experts_per_tok=2, max_position_embeddings=64)
        self.model = transformers.MixtralForCausalLM(config)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.monitor = StepMonitor(run=run, socket_path=socket_path, rank=0, world=1)
        self.layers = watch_experts(self.monitor, self.model) if counted else 0
        self.batch = torch.randint(0, 256, (4, 32))
        self.seconds: list[float] = []

    def steps(self, count: int) -> None:
        model, optimizer, batch, mon = self.model, self.optimizer, self.batch, self.monitor
        for _ in range(count):
            start = perf_counter()
            with mon.step():
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            self.seconds.append(perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block-steps", type=int, default=8)
    parser.add_argument("--control", action="store_true", help="count neither model's experts")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import torch
    from bench_hook import drained_socket

    torch.set_num_threads(1)
    with drained_socket() as (socket_path, finish):
        plain = Arm(socket_path, "bench-moe-plain", counted=False)
        watched = Arm(socket_path, "bench-moe-watched", counted=not args.control)
        plain.steps(3)  # warm-up: first allocations, the optimizer's states
        watched.steps(3)
        ratios: list[float] = []
        for round_ in range(args.rounds):
            plain.seconds.clear()
            watched.seconds.clear()
            for arm in ((plain, watched) if round_ % 2 == 0 else (watched, plain)):
                arm.steps(args.block_steps)
            ratio = statistics.median(watched.seconds) / statistics.median(plain.seconds)
            ratios.append(ratio)
            print(f"round {round_}: plain step {statistics.median(plain.seconds) * 1e3:.2f} ms, "
                  f"watched/plain {ratio:.4f}")
        stats: dict[str, Any] = {"errors": watched.monitor.stats.extension_errors,
                                 "missed": watched.monitor.stats.gpu_fields_missed}
        plain.monitor.close()
        watched.monitor.close()
        received = finish()
    added = statistics.median(ratios) - 1
    hook_s, step_s = direct_cost(watched.layers or 4)
    plain_s = statistics.median(plain.seconds)
    print(f"direct: a layer's hook {hook_s * 1e6:.1f} µs, a step's counting {step_s * 1e6:.1f} µs "
          f"= {step_s / plain_s * 100:.2f} % of the plain step")
    print(f"MoE layers counted: {watched.layers}; added per step: {added * 100:+.2f} % "
          f"(median of {args.rounds} rounds); records received: {received}")
    print(json.dumps({"bench": "moe", "control": args.control, "layers": watched.layers,
                      "added": added, "hook_us": hook_s * 1e6, "step_counting_us": step_s * 1e6,
                      "direct_share": step_s / plain_s, "ratios": ratios, "plain_step_ms":
                      statistics.median(plain.seconds) * 1e3, "records_received": received, **stats}))


def direct_cost(layers: int, calls: int = 2000) -> tuple[float, float]:
    """Seconds of one layer's hook, and of a step's counting for ``layers`` layers (hooks, the
    step's end, the window's update), for a forward of 4 x 32 tokens, top-2 of 8 experts."""
    import torch

    from gpumon.client.watchers.expert_load import ExpertLoadWatch

    watch = ExpertLoadWatch()
    chosen = torch.randint(0, 8, (128, 2))
    start = perf_counter()
    for _ in range(calls):
        watch.count_indices("0", 8, chosen)
    hook = (perf_counter() - start) / calls
    fields: dict[str, Any] = {}
    start = perf_counter()
    for _ in range(calls):
        for layer in range(layers):
            watch.count_indices(str(layer), 8, chosen)
        watch.step_end(fields)
        fields["moe"].value()
    return hook, (perf_counter() - start) / calls


if __name__ == "__main__":
    main()
