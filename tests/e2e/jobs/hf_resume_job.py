"""A Hugging Face ``Trainer`` job with no gpumon code: a small GPT-2 saving a checkpoint every
``--every`` steps (``save_steps``); with ``--crash-at N`` it dies at the end of step N, and with
``--resume`` it continues from its latest checkpoint (``resume_from_checkpoint=True``).

Its own timeline (``timeline.py``) comes from a ``TrainerCallback``: each step's begin and end,
each save's end (the save runs between the step's end and ``on_save``), and its exit. A step's
device work is a sleep before the model's forward, and a slow disk a sleep before each save of
the weights.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from timeline import Timeline


class SlowDiskTrainer(transformers.Trainer):
    """Writes its model as to a slow disk: a wait before each save of the weights."""

    save_s = 0.0

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        time.sleep(self.save_s)
        super()._save(output_dir, state_dict)


class Notes(transformers.TrainerCallback):
    def __init__(self, timeline: Timeline, crash_at: int) -> None:
        self.timeline, self.crash_at = timeline, crash_at

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.timeline.note("step_start", step=state.global_step + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.timeline.note("step_end", step=state.global_step)
        if state.global_step % args.save_steps == 0:
            self.timeline.note("save_start", step=state.global_step)  # the save comes next
        if state.global_step == self.crash_at:
            self.timeline.crash()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.timeline.note("save_end", step=state.global_step)
        self.timeline.note("save_done", step=state.global_step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--crash-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--work-s", type=float, default=0.05)
    parser.add_argument("--save-s", type=float, default=0.5)
    args = parser.parse_args()
    timeline = Timeline(args.out / f"attempt{args.attempt}.jsonl")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=2048, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    model.register_forward_pre_hook(lambda module, inputs: time.sleep(args.work_s))
    ids = torch.randint(0, 2048, (512, 32), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    training = transformers.TrainingArguments(
        output_dir=str(args.out / "hf"), max_steps=args.steps, per_device_train_batch_size=2,
        use_cpu=True, report_to=[], save_strategy="steps", save_steps=args.every,
        logging_steps=1000, disable_tqdm=True, dataloader_num_workers=0,
    )
    SlowDiskTrainer.save_s = args.save_s
    trainer = SlowDiskTrainer(model=model, args=training, train_dataset=dataset,
                              callbacks=[Notes(timeline, args.crash_at)])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    timeline.note("exit", why="done")


if __name__ == "__main__":
    main()
