"""Hugging Face ``transformers`` integration: ``Trainer(..., callbacks=[GpumonTrainerCallback()])``.

Each optimizer step is one step (all its gradient-accumulation micro-batches). ``data`` is
the wait before the step (the Trainer fetches the step's batches then); ``forward`` is timed
by hooks on the model's forward; ``backward`` runs from the end of a forward to the next
forward or the optimizer; ``optimizer`` covers the optimizer step, the scheduler and zeroing.
Under torchrun or accelerate the model as Accelerate wrapped it (DDP, FSDP, a DeepSpeed engine)
is watched (``StepMonitor.watch``), so each step also carries its collective communication; a
DeepSpeed engine's phases are its own forward, backward and step, timed by its watcher.
Samples and tokens are counted from the model's main input (tokens only for integer ids),
flops estimated as 6 · non-embedding parameters · tokens, as the Trainer itself does.

The Trainer has no exception hook: an OOM that ends training is reported when the monitor
closes at interpreter exit, from the allocator's OOM count (with CUDA).
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gpumon.client.integrations._phases import PhaseSequence
from gpumon.client.monitor import StepMonitor
from gpumon.client.watchers.watch import find_wrapper, kind_of


class GpumonTrainerCallback(TrainerCallback):  # type: ignore[misc]  # transformers is not analysed: Any
    """Reports every optimizer step of a ``transformers.Trainer`` to the gpumon agent.

    Args:
        run: the run's name (default ``$GPUMON_RUN``, else ``"default"``).
        socket_path: the agent's socket (default ``$GPUMON_SOCKET``, else the standard path).
        monitor_kwargs: more ``StepMonitor`` arguments (e.g. ``transport``).

    Rank, world size and local rank come from the ``TrainingArguments``.
    """

    def __init__(self, run: str | None = None, *, socket_path: str | None = None, **monitor_kwargs: Any):
        self._run = run
        self._socket_path = socket_path
        self._monitor_kwargs = monitor_kwargs
        self.monitor: StepMonitor | None = None
        self._phases: PhaseSequence | None = None
        self._hooks: list[Any] = []
        self._wait_start: float | None = None
        self._params = 0
        self._input_name = "input_ids"
        self._samples = self._tokens = 0
        self._engine_phases = False

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Start the monitor and hook the model's forward."""
        if self.monitor is not None:
            return
        self.monitor = StepMonitor(
            self._run,
            socket_path=self._socket_path,
            rank=args.process_index,
            world=args.world_size,
            local_rank=args.local_process_index,
            **self._monitor_kwargs,
        )
        self._phases = PhaseSequence(self.monitor)
        model = kwargs.get("model")
        if model is not None:
            self._input_name = getattr(model, "main_input_name", None) or "input_ids"
            count = getattr(model, "num_parameters", None)
            self._params = (
                count(exclude_embeddings=True)
                if callable(count)
                else sum(p.numel() for p in model.parameters())
            )
            self._hooks = [
                model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                model.register_forward_hook(self._after_forward),
            ]
            wrapper = find_wrapper(model) or model
            self.monitor.watch(wrapper, kwargs.get("optimizer"))
            # A DeepSpeed engine times its own forward, backward and step (``watch``): this
            # callback then makes the steps and counts, and opens no phase inside them.
            self._engine_phases = kind_of(wrapper) == "deepspeed"
        self._wait_start = perf_counter()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Open the step; the time since the previous one (less logging/saving) is data wait."""
        if self._phases is not None:
            self._samples = self._tokens = 0
            self._phases.start_step(self._wait_start)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Backward (and clipping) ends; the optimizer begins."""
        if self._phases is not None and not self._engine_phases:
            self._phases.switch("optimizer")

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Close the step with its counts."""
        if self._phases is None or not self._phases.in_step:
            return
        tokens = self._tokens or None
        flops = 6.0 * self._params * self._tokens if tokens and self._params else None
        self._phases.set_counts(self._samples or None, tokens, flops)
        self._phases.end_step()
        self._wait_start = perf_counter()

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Logging is not waiting for data: restart the wait clock."""
        self._wait_start = perf_counter()

    on_save = on_log
    on_evaluate = on_log

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Unhook the model, send what is left and stop."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
            self._phases = None

    def _before_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._phases is None or not self._phases.in_step:
            return  # evaluation and generation are not training steps
        ids = kwargs.get(self._input_name, args[0] if args else None)
        shape = None if ids is None else getattr(ids, "shape", None)
        if ids is not None and shape:
            self._samples += int(shape[0])
            if not ids.is_floating_point():
                self._tokens += int(ids.numel())
        if not self._engine_phases:
            self._phases.switch("forward")

    def _after_forward(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if self._phases is not None and not self._engine_phases:
            self._phases.switch("backward")
