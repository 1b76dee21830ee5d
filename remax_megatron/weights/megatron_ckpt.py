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
import queue
import shutil

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import load_tensors_metadata
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

from remax_megatron.models import build_policy, build_reward_model, read_hf_config
from remax_megatron.models.arch import DTYPES, ExpertOptions, LoraOptions, ModelArch
from remax_megatron.weights import dcp_compat
from remax_megatron.weights.hf_io import SIDE_FILES
from remax_megatron.weights.provenance import META, check_readable, installed_versions

dcp_compat.install()  # torch >= 2.15 DCP metadata with megatron-core's reader (dcp_compat.py)

FORMAT_VERSION = 1


def build_model_for(
    arch: ModelArch,
    *,
    tp: int,
    pp: int,
    params_dtype: torch.dtype,
    init_weights: bool,
    trainable: bool = False,
    experts: ExpertOptions | None = None,
    lora: LoraOptions | None = None,
):
    """The policy or reward model that `arch` describes, on the current layout (experts: a MoE model's
    expert layout, matching the initialised expert-parallel groups; lora: the adapters a checkpoint holds,
    read_checkpoint_lora)."""
    if arch.task == "reward":
        return build_reward_model(arch, tp=tp, pp=pp, params_dtype=params_dtype, init_weights=init_weights)
    return build_policy(
        arch,
        tp=tp,
        pp=pp,
        params_dtype=params_dtype,
        init_weights=init_weights,
        trainable=trainable or lora is not None,
        experts=experts,
        lora=lora,
    )


def save_model(model, ckpt_dir: str, hf_dir: str) -> None:
    """Collective: write `model` (all ranks' shards) into ckpt_dir/model and the HF side files.

    ckpt_dir must exist and be empty of a previous checkpoint (callers write into a
    temporary directory and rename it into place).
    """
    model_dir = os.path.join(ckpt_dir, "model")
    if dist.get_rank() == 0:
        os.makedirs(model_dir, exist_ok=True)
        side = os.path.join(ckpt_dir, "hf_config")
        os.makedirs(side, exist_ok=True)
        for name in SIDE_FILES:
            if os.path.isfile(os.path.join(hf_dir, name)):
                shutil.copy2(os.path.join(hf_dir, name), os.path.join(side, name))
        meta = {
            "format_version": FORMAT_VERSION,
            "architecture": model.arch.architecture,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "versions": installed_versions(),
        }  # what wrote it (weights/provenance.py)
        lora = getattr(model, "lora", None)
        if lora is not None:  # the adapters' shapes and scale: what a loader must build to read them
            meta["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)}
        with open(os.path.join(ckpt_dir, META), "w") as f:
            json.dump(meta, f, indent=2)
    dist.barrier()
    save_sharded(model.sharded_state_dict(), model_dir)
    dist.barrier()


def save_sharded(sharded_state_dict: dict, directory: str) -> None:
    """dist_checkpointing.save (torch_dist), synchronously, without megatron's results Manager.

    megatron's torch_dist writer hands its write results through a queue that it creates on first
    use from a multiprocessing Manager started with "spawn": a new interpreter that imports torch
    to unpickle them, 2-4 s of CPU before each rank's first checkpoint (every short run, every
    test launch). A synchronous save never lets the results leave this process, so an in-process
    queue serves; megatron creates its own only while `filesystem_async._results_queue` is None.
    (An asynchronous save would need megatron's queue; this project saves synchronously.)"""
    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, directory)


def read_checkpoint_meta(ckpt_dir: str) -> tuple[ModelArch, torch.dtype]:
    """Architecture and dtype of a model checkpoint; errors name the missing file, or the newer megatron-core
    that wrote it (provenance.check_readable)."""
    meta_path = os.path.join(ckpt_dir, META)
    for path in (
        meta_path,
        os.path.join(ckpt_dir, "hf_config", "config.json"),
        os.path.join(ckpt_dir, "model", "metadata.json"),
    ):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: {ckpt_dir} is not a complete remax-megatron checkpoint")
    check_readable(ckpt_dir)
    try:
        with open(meta_path) as f:
            dtype = DTYPES[json.load(f)["dtype"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{meta_path} is unreadable ({type(e).__name__}: {e}): re-convert the checkpoint") from None
    return read_hf_config(os.path.join(ckpt_dir, "hf_config")), dtype


def read_checkpoint_lora(ckpt_dir: str) -> LoraOptions | None:
    """The LoRA adapters a checkpoint holds (rank, alpha, targets), None when it has none."""
    with open(os.path.join(ckpt_dir, META)) as f:
        lora = json.load(f).get("lora")
    return LoraOptions(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"])) if lora else None


def model_checkpoint_entries(path: str) -> list[str] | None:
    """The entries of `path` when it is a model checkpoint exactly as save_model writes it (model/,
    hf_config/, remax_checkpoint.json and nothing else), else None. A training checkpoint (it also
    holds optimizer/ and trainer_state.json) or a directory with anything added is not one."""
    if not os.path.isdir(path) or os.path.islink(path):
        return None
    entries = sorted(os.listdir(path))
    if entries != sorted(["model", "hf_config", META]) or not os.path.isfile(os.path.join(path, META)):
        return None
    try:
        with open(os.path.join(path, META)) as f:
            if json.load(f).get("format_version") != FORMAT_VERSION:
                return None
    except (OSError, ValueError, AttributeError):
        return None
    side_files = (
        set(os.listdir(os.path.join(path, "hf_config"))) if os.path.isdir(os.path.join(path, "hf_config")) else None
    )
    if side_files is None or not side_files <= set(SIDE_FILES):
        return None
    model_dir = os.path.join(path, "model")
    shards = os.listdir(model_dir) if os.path.isdir(model_dir) else None
    dist_files = (".metadata", "metadata.json", "common.pt")
    if shards is None or any(not (n in dist_files or n.endswith(".distcp")) for n in shards):
        return None
    return entries


def load_model(model, ckpt_dir: str) -> None:
    """Collective: fill `model` (any TP/PP layout) from ckpt_dir/model."""
    check_shapes(model, ckpt_dir)
    state = dist_checkpointing.load(model.sharded_state_dict(), os.path.join(ckpt_dir, "model"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} does not fit the model: missing {missing}, unexpected {unexpected}")


def check_shapes(model, ckpt_dir: str) -> None:
    """ValueError (one line, both shapes) when ckpt_dir/model was saved from a model of other shapes.

    Only the checkpoint's metadata is read. Vocab-padded tensors (megatron marks them
    allow_shape_mismatch: the padding depends on TP) are compared without their vocab dim, and the
    vocab sizes through the saved config.json.
    """
    saved = load_tensors_metadata(os.path.join(ckpt_dir, "model"))
    ours = model.sharded_state_dict()
    apply_factories(ours)
    for tensor in nested_values(ours):
        if not isinstance(tensor, ShardedTensor):
            continue
        shape = tuple(tensor.global_shape)
        if tensor.key not in saved:
            raise ValueError(
                f"checkpoint {ckpt_dir} holds a different model: it has no {tensor.key} "
                f"(shape {list(shape)} in this model)"
            )
        there = tuple(saved[tensor.key].global_shape)
        padded = tensor.allow_shape_mismatch and len(shape) == len(there)
        if (shape[1:] != there[1:]) if padded else (shape != there):
            raise ValueError(
                f"checkpoint {ckpt_dir} holds a different model: {tensor.key} has shape "
                f"{list(there)} there and {list(shape)} in this model"
            )
    arch = getattr(model, "arch", None)
    config = os.path.join(ckpt_dir, "hf_config", "config.json")
    if arch is not None and os.path.isfile(config):
        try:
            with open(config) as f:
                vocab = json.load(f).get("vocab_size")
        except (OSError, ValueError, AttributeError):
            vocab = None
        if vocab is not None and vocab != arch.vocab_size:
            raise ValueError(
                f"checkpoint {ckpt_dir} holds a different model: vocab_size {vocab} there "
                f"({config}) and {arch.vocab_size} in this model"
            )
