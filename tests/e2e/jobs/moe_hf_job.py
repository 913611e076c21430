"""A tiny Mixtral (Hugging Face ``MixtralForCausalLM``) trained on CPU, unchanged (no gpumon
import), so that it runs under ``gpumon run``.

Its router is skewed at the start, as a fresh MoE often is: the first expert's row of each
router is scaled up, so it wins more tokens than the others until training evens it out.

The job writes to ``OUT/rank0.json`` its own expert load, independently of gpumon: from the
router logits the model returns (``output_router_logits``), each token's top-k experts by the
router's softmax, counted per layer and step, and over the last ``--window`` steps per layer
the busiest expert's tokens over the mean, the coefficient of variation and the experts with
no token.

    moe_hf_job.py --out OUT [--steps N] [--window W] [--sleep S]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import transformers

EXPERTS = 8
TOP_K = 2
LAYERS = 3
VOCAB = 128


def figures(counts: list[int]) -> dict[str, float]:
    mean = sum(counts) / len(counts)
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts))
    return {"max_ratio": max(counts) / mean, "cv": std / mean, "dead": counts.count(0),
            "tokens": sum(counts)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--sleep", type=float, default=0.0, help="device-like work per step")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, output_router_logits=True, max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[0] *= 4.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history: list[list[list[int]]] = []  # step -> layer -> tokens per expert
    for _ in range(args.steps):
        ids = torch.randint(0, VOCAB, (4, 16))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            chosen = [torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K, dim=-1).indices
                      for logits in out.router_logits]
            history.append([torch.bincount(c.reshape(-1), minlength=EXPERTS).tolist() for c in chosen])
        if args.sleep:
            time.sleep(args.sleep)
    window = history[-args.window:]
    layers = {str(layer): figures([sum(step[layer][e] for step in window) for e in range(EXPERTS)])
              for layer in range(LAYERS)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rank0.json").write_text(json.dumps({"window": len(window), "layers": layers}))


if __name__ == "__main__":
    main()
