"""A LoRA actor's adapters as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).

    write_peft_dir(actor, out_dir, base_model="meta-llama/...")    # collective: every rank calls it
    # then, anywhere: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out_dir)

megatron fuses what PEFT keeps apart, so each fused adapter becomes one PEFT adapter per HF module, through
the same row layout the weight export uses (weights/mapping.py `merge_shards`):
- linear_qkv: A [r, D] is shared, B's rows are q, k, v per query group -> q_proj / k_proj / v_proj, each
  with lora_A = A and lora_B = its rows of B (B_q A = the q rows of B A, so the update is the same);
- linear_fc1: B's rows [gate; up] per TP rank -> gate_proj / up_proj, each with lora_A = A;
- linear_proj, linear_fc2 (row parallel): A's TP shards concatenated on dim 1 -> o_proj / down_proj.
PEFT's scale is lora_alpha / r, as here. TP shards are gathered over the tensor-parallel group, pipeline
stages (and data-parallel replica 0 only) sent to rank 0, which writes.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from remax_megatron.models.families.base import FC1, QKV, ROW
from remax_megatron.parallel import ProcessGroups
from remax_megatron.weights.load import local_param_name, mapping_for

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _peft_name(hf_name: str, part: str) -> str:
    """HF "model.layers.0.self_attn.q_proj.weight" -> PEFT's saved "base_model.model.model.layers.0.self_attn
    .q_proj.lora_A.weight"."""
    return f"base_model.model.{hf_name[: -len('.weight')]}.{part}.weight"


def peft_adapter_tensors(model, groups: ProcessGroups | None = None) -> dict[str, torch.Tensor]:
    """Collective over the world: every adapter as PEFT names it, full tensors on rank 0 ({} elsewhere)."""
    from remax_megatron.models.lora import lora_modules

    groups = groups or ProcessGroups.current()
    mapping = mapping_for(model)
    params = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
    modules = lora_modules(model)
    mine: dict[str, torch.Tensor] = {}
    if groups.dp_rank == 0:  # every data-parallel replica holds the same adapters
        for spec in mapping.exported_specs():
            name = local_param_name(model, mapping, spec, params) if spec.stage == groups.pp_rank else None
            module = modules.get(name) if name else None
            if module is None:
                continue
            column = spec.kind in (QKV, FC1)
            assert column or spec.kind == ROW, spec
            split = (module.lora_B if column else module.lora_A).detach().contiguous()
            shards = [split]
            if groups.tp_size > 1:  # every TP rank of this stage holds the module: gather in rank order
                shards = [torch.empty_like(split) for _ in range(groups.tp_size)]
                dist.all_gather(shards, split, group=groups.tp)
            if groups.tp_rank:
                continue
            r = split.shape[1] if column else split.shape[0]
            if column:  # B's rows, per HF module; A shared
                outs = [torch.empty(shape[0], r, dtype=split.dtype, device=split.device) for shape in spec.shapes]
                for hf_name, b in mapping.merge_shards(spec, shards, out=outs):
                    mine[_peft_name(hf_name, "lora_A")] = module.lora_A.detach().cpu().clone()
                    mine[_peft_name(hf_name, "lora_B")] = b.cpu()
            else:  # A's columns; B replicated
                out = [torch.empty(r, spec.shapes[0][1], dtype=split.dtype, device=split.device)]
                ((hf_name, a),) = mapping.merge_shards(spec, shards, out=out)
                mine[_peft_name(hf_name, "lora_A")] = a.cpu()
                mine[_peft_name(hf_name, "lora_B")] = module.lora_B.detach().cpu().clone()
    if dist.get_world_size() == 1:
        return mine
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    return {k: v for part in every for k, v in part.items()} if every is not None else {}


def write_peft_dir(model, out_dir: str, base_model: str = "", groups: ProcessGroups | None = None) -> None:
    """Collective: the adapters of LoRA `model` as a PEFT directory at `out_dir` (written by rank 0, into a
    temporary directory renamed at the end: an interrupted write leaves no half adapter)."""
    from safetensors.torch import save_file

    options = getattr(model, "lora", None)
    if options is None:
        raise ValueError("the model has no LoRA adapters to write as a PEFT directory (actor.lora_rank=0)")
    tensors = peft_adapter_tensors(model, groups)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    modules = sorted({name.split(".")[-3] for name in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": options.rank,
        "lora_alpha": options.alpha,
        "lora_dropout": options.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    os.makedirs(tmp)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"}
    )
    with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    os.replace(tmp, out_dir)
