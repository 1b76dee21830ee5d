"""Export full HF-named tensors from a TP/PP-sharded megatron model, as an iterator.

The owning pipeline stage all-gathers the TP shards and rebuilds the HF tensors;
then broadcasts each over the pipeline group, so every rank of the model-parallel
group yields the same stream `(hf_name, tensor)` in HF order. Data-parallel
replicas export independently (their weights are equal). Used by the rollout
weight sync, HF export and checkpoint conversion.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from remax_megatron.weights.load import mapping_for, uses_te_names


@torch.no_grad()
def export_hf_weights(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every HF tensor of `model`, on every rank of its TP x PP group.

    dtype: cast to this dtype (e.g. the engine's) after gathering; None keeps the parameter dtype.
    """
    from megatron.core import parallel_state as ps

    mapping = mapping_for(model)
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    tp, stage = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    params = model.state_dict(keep_vars=True)
    te = uses_te_names(params)
    for spec in mapping.exported_specs():
        if spec.stage == stage:
            shard = params[spec.local_name(mapping.layers_per_stage, te_names=te)].detach()
            if tp > 1 and spec.kind != "replicated":
                shards = [torch.empty_like(shard) for _ in range(tp)]
                dist.all_gather(shards, shard.contiguous(), group=tp_group)
            else:
                shards = [shard]
            tensors = mapping.merge_shards(spec, shards)
            param_dtype = shard.dtype
        else:
            param_dtype = _stage_param_dtype(params)
            tensors = [(n, torch.empty(mapping.hf_shape(n), dtype=param_dtype, device=_device(params)))
                       for n in spec.hf]
        for name, tensor in tensors:
            tensor = tensor.contiguous()
            if mapping.pp > 1:
                dist.broadcast(tensor, src=dist.get_global_rank(pp_group, spec.stage), group=pp_group)
            yield name, (tensor if dtype is None else tensor.to(dtype))


def _stage_param_dtype(params) -> torch.dtype:
    # All stages share one params dtype (megatron's TransformerConfig.params_dtype).
    return next(p.dtype for k, p in params.items() if not k.endswith("_extra_state"))


def _device(params) -> torch.device:
    return next(p.device for k, p in params.items() if not k.endswith("_extra_state"))
