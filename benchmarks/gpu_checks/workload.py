"""The training workloads the device checks run: a bf16 transformer (GPU-bound) and a small
MLP (launch-bound, where the hook's own cost would show), on CUDA or, for a dry run, tiny on
the CPU; trained bare or through ``StepMonitor`` with forward/backward/optimizer phases."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class Workload:
    """A model, its optimizer and endless synthetic batches, on CUDA or the CPU."""

    def __init__(self, torch: Any, kind: str, device: str) -> None:
        from torch import nn

        self.torch = torch
        self.device = device
        self.kind = kind
        cuda = device == "cuda"
        torch.manual_seed(0)
        if kind == "transformer":
            d, layers, heads, self.seq, self.batch, self.vocab = (
                (1024, 8, 16, 512, 16, 8192) if cuda else (64, 2, 4, 32, 8, 256))
            layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                               norm_first=True)
            self.model = nn.Sequential(
                nn.Embedding(self.vocab, d),
                nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                nn.Linear(d, self.vocab),
            ).to(device)
            self.batches = [
                (torch.randint(0, self.vocab, (self.batch, self.seq), device=device),
                 torch.randint(0, self.vocab, (self.batch, self.seq), device=device))
                for _ in range(4)]
            self.tokens = self.batch * self.seq
        else:  # a small MLP: launch-bound, where the hook's own cost would show
            width, self.batch = 256, 64
            self.model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(width, width),
                                                                       nn.ReLU())),
                                       nn.Linear(width, 10)).to(device)
            self.batches = [(torch.randn(self.batch, width, device=device),
                             torch.randint(0, 10, (self.batch,), device=device))
                            for _ in range(4)]
            self.tokens = self.batch
        self.params = sum(p.numel() for p in self.model.parameters())
        self.flops = 6.0 * self.params * self.tokens
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda
                         else contextlib.nullcontext())
        self._i = 0

    def data(self) -> Iterator[tuple[Any, Any]]:
        while True:
            self._i += 1
            yield self.batches[self._i % len(self.batches)]

    def loss(self, x: Any, y: Any) -> Any:
        F = self.torch.nn.functional  # noqa: N806
        with self.autocast:
            out = self.model(x)
            if self.kind == "transformer":
                return F.cross_entropy(out.view(-1, self.vocab).float(), y.view(-1))
            return F.cross_entropy(out.float(), y)

    def train(self, steps: int, mon: Any = None, memory: dict[str, int] | None = None) -> None:
        data = self.data()
        opt = self.optimizer
        if mon is None:
            for _ in range(steps):
                x, y = next(data)
                loss = self.loss(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return
        for k, (x, y) in enumerate(mon.loader(data)):
            if k >= steps:
                break
            with mon.step(samples=self.batch, tokens=self.tokens, flops=self.flops, memory=memory):
                with mon.phase("forward"):
                    loss = self.loss(x, y)
                with mon.phase("backward"):
                    loss.backward()
                with mon.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

