"""The model weights a checkpoint saved, read in the test's own process (no process group, no
converter launch): dist_checkpointing's torch_dist format is torch DCP, whose tensors are global."""

import json
import os
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")  # padded to a multiple of 128 * TP


def saved_weights(ckpt_dir) -> dict[str, torch.Tensor]:
    """{megatron name: full tensor} of `ckpt_dir`/model, whatever TP/PP/DP saved it (layers stacked
    on dim 0, e.g. decoder.layers.self_attention.linear_qkv.weight [layers, qkv rows, hidden]); the
    vocabulary rows cut to the model's vocab_size (the padding depends on TP)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pt")
        dcp_to_torch_save(os.path.join(str(ckpt_dir), "model"), path)
        state = torch.load(path, weights_only=False)
    with open(os.path.join(str(ckpt_dir), "hf_config", "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return {
        name: value[:vocab] if name in VOCAB_ROWS else value
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)
