"""Make a tiny Hugging Face Llama or Qwen2 directory offline (random weights, local tokenizer).

    python tools/make_tiny_model.py --family qwen2 --out /tmp/tiny-qwen2 \
        --hidden 64 --layers 4 --heads 4 --kv-heads 2 --ffn 128 --vocab 300
    python tools/make_tiny_model.py --family llama --tie --out /tmp/tiny-llama
    python tools/make_tiny_model.py --family llama --reward --out /tmp/tiny-rm

The tokenizer is character level (remax_megatron.builtin.tokenizer); --vocab
adds filler tokens so sizes such as "not a multiple of 128*TP" can be tested.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_tiny_model(out: str, family: str = "llama", hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 128, vocab: int | None = None, tie: bool = False,
                    reward: bool = False, qkv_bias: bool | None = None, rope_theta: float = 10000.0,
                    max_positions: int = 512, dtype: str = "float32", seed: int = 0,
                    overwrite: bool = False) -> str:
    import torch
    import transformers

    from remax_megatron.builtin.tokenizer import build_tokenizer
    from remax_megatron.weights.hf_io import holds_checkpoint

    if family not in ("llama", "qwen2"):
        raise ValueError(f"--family {family!r} is not supported: use llama or qwen2")
    if holds_checkpoint(out) and not overwrite:
        raise FileExistsError(f"{out} already holds a model: choose a new --out or pass --overwrite")
    tokenizer = build_tokenizer(vocab)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        rms_norm_eps=1e-6, tie_word_embeddings=tie and not reward,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if family == "llama":
        config = transformers.LlamaConfig(attention_bias=bool(qkv_bias), **common)
    else:
        config = transformers.Qwen2Config(**common)
    if reward:
        config.num_labels = 1
        cls = transformers.LlamaForSequenceClassification if family == "llama" \
            else transformers.Qwen2ForSequenceClassification
    else:
        cls = transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(getattr(torch, dtype))
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb so parity tests see them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--family", default="llama", choices=["llama", "qwen2"])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--vocab", type=int, default=None, help="total vocab (filler tokens added); default: chars only")
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    p.add_argument("--reward", action="store_true", help="a *ForSequenceClassification reward model (1 label)")
    p.add_argument("--qkv-bias", action="store_true", help="Llama with attention_bias (Qwen2 always has it)")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    try:
        out = make_tiny_model(a.out, a.family, a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, a.vocab, a.tie,
                              a.reward, a.qkv_bias, a.rope_theta, a.max_positions, a.dtype, a.seed, a.overwrite)
    except (ValueError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
