"""Rank-aware output in one place: print0, metrics.jsonl, TensorBoard, optional wandb, a tqdm bar."""

from __future__ import annotations

import json
import math
import os

import torch.distributed as dist


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    if is_rank0():
        print(*args, **kwargs, flush=True)


class MetricsLogger:
    """One sink for training and eval records; everything is a no-op off rank 0."""

    def __init__(self, output_dir: str, total_steps: int, start_step: int = 0, tensorboard: bool = True,
                 wandb_project: str = "", progress_bar: bool = True, config: dict | None = None):
        self.active = is_rank0()
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.tb = self.wandb = self.bar = None
        if not self.active:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.file = open(self.path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ValueError(f"logging.wandb_project={wandb_project!r} but wandb is not installed: "
                                 "pip install wandb or set logging.wandb_project=''") from None
            self.wandb = wandb.init(project=wandb_project, config=config or {}, dir=output_dir)
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="remax", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if not self.active:
            return
        clean = {k: (float(v) if not isinstance(v, (int, str)) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean, allow_nan=True) + "\n")
        self.file.flush()
        step = clean["step"]
        for key, value in clean.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                if self.tb is not None:
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)

    def progress(self, step: int, record: dict) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({k.split("/")[-1] + ("" if k.startswith("reward") else ""): f"{record[k]:.3f}"
                                  for k in ("reward/sampled_mean", "reward/greedy_mean", "loss") if k in record},
                                 refresh=True)

    def write(self, text: str) -> None:
        """Print without breaking the progress bar."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self.active:
            return
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
