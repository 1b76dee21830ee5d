"""Model weights as a megatron distributed checkpoint (layout-free: any TP/PP loads it).

A model checkpoint directory holds:
    model/            megatron dist_checkpointing (torch_dist) of the model's sharded state dict
    hf_config/        the source model's config.json, tokenizer and generation config
    remax_checkpoint.json   what it is (architecture, dtype, format version)
Training checkpoints (checkpoint.py) add optimizer, scheduler and RNG state beside these.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from remax_megatron.models import build_policy, build_reward_model, read_hf_config
from remax_megatron.models.hf_config import DTYPES, ModelArch
from remax_megatron.weights.hf_io import SIDE_FILES

FORMAT_VERSION = 1
META = "remax_checkpoint.json"


def build_model_for(arch: ModelArch, *, tp: int, pp: int, params_dtype: torch.dtype, init_weights: bool,
                    trainable: bool = False):
    """The policy or reward model that `arch` describes, on the current layout."""
    if arch.task == "reward":
        return build_reward_model(arch, tp=tp, pp=pp, params_dtype=params_dtype, init_weights=init_weights)
    return build_policy(arch, tp=tp, pp=pp, params_dtype=params_dtype, init_weights=init_weights,
                        trainable=trainable)


def save_model(model, ckpt_dir: str, hf_dir: str) -> None:
    """Collective: write `model` (all ranks' shards) into ckpt_dir/model and the HF side files.

    ckpt_dir must exist and be empty of a previous checkpoint (callers write into a
    temporary directory and rename it into place).
    """
    from megatron.core import dist_checkpointing

    model_dir = os.path.join(ckpt_dir, "model")
    if dist.get_rank() == 0:
        os.makedirs(model_dir, exist_ok=True)
        side = os.path.join(ckpt_dir, "hf_config")
        os.makedirs(side, exist_ok=True)
        for name in SIDE_FILES:
            if os.path.isfile(os.path.join(hf_dir, name)):
                shutil.copy2(os.path.join(hf_dir, name), os.path.join(side, name))
        with open(os.path.join(ckpt_dir, META), "w") as f:
            json.dump({"format_version": FORMAT_VERSION, "architecture": model.arch.architecture,
                       "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}, f, indent=2)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), model_dir)
    dist.barrier()


def read_checkpoint_meta(ckpt_dir: str) -> tuple[ModelArch, torch.dtype]:
    """Architecture and dtype of a model checkpoint; errors name the missing file."""
    meta_path = os.path.join(ckpt_dir, META)
    for path in (meta_path, os.path.join(ckpt_dir, "hf_config", "config.json"),
                 os.path.join(ckpt_dir, "model", "metadata.json")):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: {ckpt_dir} is not a complete remax-megatron checkpoint")
    with open(meta_path) as f:
        meta = json.load(f)
    return read_hf_config(os.path.join(ckpt_dir, "hf_config")), DTYPES[meta["dtype"]]


def load_model(model, ckpt_dir: str) -> None:
    """Collective: fill `model` (any TP/PP layout) from ckpt_dir/model."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), os.path.join(ckpt_dir, "model"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} does not fit the model: missing {missing}, unexpected {unexpected}")
