"""Load an HF safetensors directory into this rank's TP/PP shard of a megatron model."""

from __future__ import annotations

import torch

from remax_megatron.models.hf_config import padded_vocab_size
from remax_megatron.models.arch import is_adapter
from remax_megatron.weights.hf_io import HFCheckpointReader
from remax_megatron.weights.mapping import ParamSpec, WeightMapping, resolve_name


def _layout(model) -> tuple[int, int, int, int]:
    """(tp, pp, tp_rank, pp_rank) of the groups the model was built on (megatron's global ones or its own)."""
    return model.tp_group.size(), model.pp_group.size(), model.tp_group.rank(), model.pp_group.rank()


def expert_layout(model) -> tuple[int, int, int, int]:
    """(ep, etp, ep_rank, etp_rank) of a MoE model (megatron's expert groups); (1, 1, 0, 0) when dense."""
    if not model.arch.is_moe:
        return 1, 1, 0, 0
    from megatron.core import parallel_state as ps

    return (
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_tensor_parallel_rank(),
    )


def mapping_for(model) -> WeightMapping:
    """The WeightMapping of a model built by remax_megatron.models (its arch and layout)."""
    tp, pp, _, _ = _layout(model)
    ep, etp, _, _ = expert_layout(model)
    vocab_rows = model.embedding.word_embeddings.weight.shape[0] if model.pre_process else None
    if vocab_rows is None:
        vocab_rows = _padded_rows_from_output(model)
    return WeightMapping(model.arch, tp=tp, pp=pp, padded_vocab=vocab_rows * tp, ep=ep, etp=etp)


def local_param_name(model, mapping: WeightMapping, spec: ParamSpec, params) -> str | None:
    """`spec`'s name in this rank's state dict `params` (local layer and expert indices, local or TE
    spec names); None when this rank does not hold it (another stage or expert-parallel rank, or the
    tied output weight at PP=1, which lives in the embedding)."""
    _, _, ep_rank, _ = expert_layout(model)
    if not mapping.owns(spec, ep_rank):
        return None
    try:
        return resolve_name(spec.local_name(mapping.layers_per_stage, mapping.first_expert(ep_rank)), params)
    except KeyError:
        return None


def _padded_rows_from_output(model) -> int:
    if model.arch.task == "reward" or model.output_layer.weight is None:
        # Reward models / tied PP=1 have no vocab-parallel tensor on this stage; nothing uses the size.

        tp = model.tp_group.size()
        return padded_vocab_size(model.arch.vocab_size, tp) // tp
    return model.output_layer.weight.shape[0]


@torch.no_grad()
def load_hf_weights(model, model_dir: str | HFCheckpointReader) -> None:
    """Fill every parameter of this rank's stage from `model_dir`, reading only this rank's slices.

    Raises before copying anything when a tensor is missing or has the wrong shape.
    """
    reader = model_dir if isinstance(model_dir, HFCheckpointReader) else HFCheckpointReader(model_dir)
    mapping = mapping_for(model)
    _, _, tp_rank, stage = _layout(model)
    _, _, ep_rank, etp_rank = expert_layout(model)
    # LoRA adapters have no HF source: they keep their init (B = 0: the loaded model unchanged).
    params = {
        k: v
        for k, v in model.state_dict(keep_vars=True).items()
        if not k.endswith("_extra_state") and not is_adapter(k)
    }
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
        from remax_megatron.models.families.deepseek_moe import say_mtp_dropped

        say_mtp_dropped(model.arch, reader.model_dir)
    mine = [s for s in mapping.stage_specs(stage) if mapping.owns(s, ep_rank)]
    for spec in mine:
        for name in spec.hf:
            if name not in reader:
                raise ValueError(
                    f"{reader.model_dir} lacks tensor {name} that a {model.arch.architecture} "
                    "needs: is the checkpoint complete and of this architecture?"
                )
    shards, seen = {}, set()
    for spec in mine:
        local = local_param_name(model, mapping, spec, params)
        if local is None:
            continue  # tied output weight at PP=1 lives in the embedding
        shard = mapping.load_shard(spec, reader.read, etp_rank if spec.expert is not None else tp_rank)
        target = params[local]
        if tuple(shard.shape) != tuple(target.shape):
            raise ValueError(
                f"{spec.hf} -> {local}: shape {tuple(shard.shape)} but the model has "
                f"{tuple(target.shape)}: does config.json match the weights?"
            )
        shards[local] = shard
        seen.add(local)
    missing = sorted(set(params) - seen)
    if missing:
        raise AssertionError(f"parameters with no HF source: {missing}")
    for local, shard in shards.items():
        params[local].copy_(shard.to(params[local].dtype))
