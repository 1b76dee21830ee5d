"""Rank-aware output in one place: print0, metrics.jsonl, TensorBoard, optional wandb, a tqdm bar
(what the libraries print is decided in remax_megatron/console.py)."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from remax_megatron.parallel import all_reduce_cpu


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    """Print on rank 0, on a line of its own while a progress bar is shown (the bar is cleared and
    redrawn around it: printed over the bar, "resumed from ..." was glued to its text)."""
    if is_rank0():
        from tqdm import tqdm

        with tqdm.external_write_mode(file=kwargs.get("file")):
            print(*args, **kwargs, flush=True)


GAP_KEY = "logprob/engine_vs_actor_max_diff"


def run_summary(output_dir: str) -> str:
    """A finished run's last console line, from its metrics.jsonl: greedy eval first -> last, the largest
    engine-vs-actor log-prob gap of any step, and where the outputs are."""
    records = []
    path = os.path.join(output_dir, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    evals = [(r["step"], r["eval/reward_mean"]) for r in records if "eval/reward_mean" in r]
    gaps = [(r[GAP_KEY], r["step"]) for r in records if isinstance(r.get(GAP_KEY), (int, float))]
    said = [
        f"eval {evals[0][1]:.4g} -> {evals[-1][1]:.4g} (step {evals[0][0]} -> {evals[-1][0]})"
        if evals
        else "no eval (trainer.eval_every=0)"
    ]
    if gaps:
        gap, step = max(gaps)
        said.append(f"largest engine-vs-actor log-prob gap {gap:.2g} (step {step})")
    return f"done: {', '.join(said)}; outputs in {output_dir} (metrics.jsonl, config.yaml, checkpoints/)"


def reduce_totals(local: dict[str, float], group=None, maximum: tuple[str, ...] = ()) -> dict[str, float]:
    """Each entry of `local` summed over the ranks of `group` (the keys in `maximum`: their max), in
    float64, one all-reduce per kind. group None: this rank's values (nothing to reduce)."""
    out = {}
    for keys, op in (
        ([k for k in local if k not in maximum], dist.ReduceOp.SUM),
        ([k for k in local if k in maximum], dist.ReduceOp.MAX),
    ):
        if keys:
            t = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64)
            t = all_reduce_cpu(t, op=op, group=group) if group is not None else t
            out.update(zip(keys, t.tolist()))
    return out


def global_mean(values: list[float], group=None) -> float:
    """Mean of every rank's `values` together (ranks with more values weigh more)."""
    t = reduce_totals({"sum": sum(values), "n": len(values)}, group)
    return t["sum"] / max(t["n"], 1)


def count_weighted(local: dict[str, float], count_key: str, group=None) -> dict[str, float]:
    """Per-rank metrics over all ranks: `*_mean` weighted by each rank's `local[count_key]` (which is
    summed, as is anything not ending in `_mean`)."""
    count = local.get(count_key, 1.0)
    totals = reduce_totals(
        {**{k: v * count if k.endswith("_mean") else v for k, v in local.items()}, "_weight": count}, group
    )
    weight = max(totals.pop("_weight"), 1.0)
    return {k: v / weight if k.endswith("_mean") else v for k, v in sorted(totals.items())}


class MetricsLogger:
    """One sink for training and eval records; everything is a no-op off rank 0.

    Nothing is written before the first record: a run that fails before it has trained or evaluated
    anything leaves the output directory as it was (no metrics.jsonl, no TensorBoard events, and
    `on_first_record` -- train.py writes config.yaml there -- is not called). The first record's
    step also tells where this run starts: rows of an earlier attempt at that step or later (a
    resume from an older checkpoint than the newest, e.g. after a corrupt one was skipped) are
    moved from metrics.jsonl to metrics.superseded.jsonl, and TensorBoard purges them.
    """

    def __init__(
        self,
        output_dir: str,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        wandb_project: str = "",
        progress_bar: bool = True,
        config: dict | None = None,
        on_first_record: Callable[[], None] | None = None,
    ):
        self.active = is_rank0()
        self.output_dir, self.tensorboard, self.on_first_record = output_dir, tensorboard, on_first_record
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.file = self.tb = self.wandb = self.bar = None
        self.records = 0
        if not self.active:
            return
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ValueError(
                    f"logging.wandb_project={wandb_project!r} but wandb is not installed: "
                    "pip install wandb or set logging.wandb_project=''"
                ) from None
            self.wandb = wandb.init(project=wandb_project, config=config or {}, dir=output_dir)
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="remax", dynamic_ncols=True)
            # a warning shown while the bar is up gets a line of its own too
            self._showwarning = warnings.showwarning

            def showwarning(*args, **kwargs):
                with tqdm.external_write_mode(file=sys.stderr):
                    self._showwarning(*args, **kwargs)

            warnings.showwarning = showwarning

    def _start(self, first_step: int) -> None:
        """Open the sinks at the first record, `first_step` being its step."""
        os.makedirs(self.output_dir, exist_ok=True)
        superseded = _split_metrics(self.path, first_step)
        if superseded:
            self.write(
                f"metrics: {superseded} rows of steps >= {first_step} from an earlier attempt moved to "
                f"{os.path.join(self.output_dir, SUPERSEDED)}"
            )
        self.file = open(self.path, "a")
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(self.output_dir, "tensorboard"), purge_step=first_step)
        if self.on_first_record is not None:
            self.on_first_record()

    def log(self, record: dict) -> None:
        if not self.active:
            return
        if self.file is None:
            self._start(int(record["step"]))
        self.records += 1
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
            self.bar.set_postfix(
                {
                    k.split("/")[-1] + ("" if k.startswith("reward") else ""): f"{record[k]:.3f}"
                    for k in ("reward/sampled_mean", "reward/greedy_mean", "loss")
                    if k in record
                },
                refresh=True,
            )

    def write(self, text: str) -> None:
        """Print a line on rank 0 without breaking the progress bar."""
        if self.active:
            print0(text)

    def warn(self, text: str) -> None:
        """A warning line on stderr, without breaking the progress bar."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.active:
            return
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()
            warnings.showwarning = self._showwarning
        if self.wandb is not None:
            self.wandb.finish()


SUPERSEDED = "metrics.superseded.jsonl"


def _split_metrics(path: str, first_step: int) -> int:
    """Move the rows of `path` whose step is >= first_step to metrics.superseded.jsonl (appended),
    keeping the rest in order; returns how many moved. Rewritten atomically."""
    if not os.path.isfile(path):
        return 0
    keep, moved = [], []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                step = None
            (moved if isinstance(step, (int, float)) and step >= first_step else keep).append(line)
    if moved:
        with open(os.path.join(os.path.dirname(path), SUPERSEDED), "a") as f:
            f.writelines(moved)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)
    return len(moved)
