"""PyTorch Lightning integration: ``trainer = Trainer(callbacks=[GpumonCallback(run="x")])``.

Each training batch is one step: ``data`` is the wait between batches (fetching and moving
the batch), ``forward`` runs to the loss, ``backward`` is the backward pass, ``optimizer``
covers clipping, the optimizer step and zeroing. Under the ``ddp`` and ``fsdp`` strategies
the wrapped model is watched (``StepMonitor.watch``), so each step also carries the
collective communication inside it. Imports ``lightning.pytorch``, falling back to the older
``pytorch_lightning`` package.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package of Lightning < 2
    import pytorch_lightning as pl

from gpumon.client.core.batches import batch_size
from gpumon.client.integrations._phases import PhaseSequence
from gpumon.client.monitor import StepMonitor
from gpumon.client.watchers.watch import kind_of


class GpumonCallback(pl.Callback):  # type: ignore[misc]  # Lightning is not analysed: Any
    """Reports every training batch to the gpumon agent as a step with its phases.

    Args:
        run: the run's name (default ``$GPUMON_RUN``, else ``"default"``).
        socket_path: the agent's socket (default ``$GPUMON_SOCKET``, else the standard path).
        tokens: a function of the batch giving its token count, when that means something.
        flops: a function of the batch giving the step's floating-point operations.
        monitor_kwargs: more ``StepMonitor`` arguments (e.g. ``transport``).

    Rank, world size and local rank come from the trainer.
    """

    def __init__(
        self,
        run: str | None = None,
        *,
        socket_path: str | None = None,
        tokens: Callable[[Any], int] | None = None,
        flops: Callable[[Any], float] | None = None,
        **monitor_kwargs: Any,
    ) -> None:
        super().__init__()
        self._run = run
        self._socket_path = socket_path
        self._tokens = tokens
        self._flops = flops
        self._monitor_kwargs = monitor_kwargs
        self.monitor: StepMonitor | None = None
        self._phases: PhaseSequence | None = None
        self._wait_start: float | None = None
        self._engine_phases = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Start the monitor for fitting, once the trainer knows the process's rank."""
        if stage != "fit" or self.monitor is not None:
            return
        self.monitor = StepMonitor(
            self._run,
            socket_path=self._socket_path,
            rank=trainer.global_rank,
            world=trainer.world_size,
            local_rank=trainer.local_rank,
            **self._monitor_kwargs,
        )
        self._phases = PhaseSequence(self.monitor)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Watch the model as the strategy wrapped it (DDP, FSDP) and its optimizer."""
        if self.monitor is not None:
            model = trainer.strategy.model
            optimizers = trainer.optimizers
            watched = pl_module if model is None else model
            self.monitor.watch(watched, optimizers[0] if optimizers else None)
            # Under DeepSpeedStrategy the engine's watcher times its forward, backward and step:
            # this callback then makes the steps and counts, and opens no phase inside them.
            self._engine_phases = kind_of(watched) == "deepspeed"

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The first batch's wait starts here."""
        self._wait_start = perf_counter()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Open the step, counting the time since the previous batch as data wait."""
        if self._phases is None:
            return
        self._phases.start_step(
            self._wait_start,
            samples=batch_size(batch),
            tokens=None if self._tokens is None else self._tokens(batch),
            flops=None if self._flops is None else self._flops(batch),
        )
        if not self._engine_phases:
            self._phases.switch("forward")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        """Forward ends, backward begins."""
        if self._phases is not None and not self._engine_phases:
            self._phases.switch("backward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Backward ends; what follows up to the batch's end is the optimizer's."""
        if self._phases is not None and not self._engine_phases:
            self._phases.switch("optimizer")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Close the step; the next batch's wait starts now."""
        if self._phases is not None:
            self._phases.end_step()
        self._wait_start = perf_counter()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Close an open step with the exception (an OOM becomes an ``oom`` event)."""
        if self._phases is not None:
            self._phases.end_step(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Send what is left and stop."""
        if stage == "fit" and self.monitor is not None:
            self.monitor.close()
            self.monitor = None
            self._phases = None
