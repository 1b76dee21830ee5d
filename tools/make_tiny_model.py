"""Make a tiny Hugging Face model of any registered family offline (random weights, local tokenizer).

    python tools/make_tiny_model.py --family qwen2 --out /tmp/tiny-qwen2 \
        --hidden 64 --layers 4 --heads 4 --kv-heads 2 --ffn 128 --vocab 300
    python tools/make_tiny_model.py --family qwen3 --out /tmp/tiny-qwen3 --hidden 128 --head-dim 64
    python tools/make_tiny_model.py --family mistral --out /tmp/tiny-mistral --sliding-window 256
    python tools/make_tiny_model.py --family qwen3_moe --out /tmp/tiny-moe --hidden 128 --ffn 64 --experts 4 --top-k 2
    python tools/make_tiny_model.py --family glm4_moe --out /tmp/tiny-glm --hidden 72 --head-dim 20 --layers 3
    python tools/make_tiny_model.py --family gpt_oss --out /tmp/tiny-oss --hidden 48 --head-dim 12 --heads 6 \
        --kv-heads 2 --ffn 20 --layers 4 --sliding-window 5 --vocab 300
    python tools/make_tiny_model.py --family deepseek_v3 --out /tmp/tiny-dsv3 --hidden 48 --heads 4 --layers 4 \
        --vocab 300 --yarn                      # MLA: q latent 20, kv latent 18, nope 10 + rope 6, v 14
    python tools/make_tiny_model.py --family deepseek_v3 --out /tmp/tiny-dsv3-lite --q-lora-rank 0  # one q proj
    python tools/make_tiny_model.py --family llama --tie --out /tmp/tiny-llama
    python tools/make_tiny_model.py --family llama --reward --out /tmp/tiny-rm

The model code is remax_megatron.builtin.tiny; the tokenizer is character level
(remax_megatron.builtin.tokenizer); --vocab adds filler tokens so sizes such as
"not a multiple of 128*TP" can be tested.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from remax_megatron.console import quiet_console  # noqa: E402

from remax_megatron.builtin.tiny import make_tiny_model  # noqa: E402  (tests import it from here too)
from remax_megatron.models import families  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--family", default="llama", choices=[f.name for f in families.families()])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--vocab", type=int, default=None, help="total vocab (filler tokens added); default: chars only")
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    p.add_argument("--reward", action="store_true", help="a *ForSequenceClassification reward model (1 label)")
    p.add_argument("--head-dim", type=int, default=None, help="qwen3, mistral: head_dim (default hidden / heads)")
    p.add_argument(
        "--sliding-window", type=int, default=None, help="mistral, gpt_oss: attention window (default none; gpt_oss 4)"
    )
    p.add_argument("--experts", type=int, default=None, help="qwen3_moe, mixtral: experts per layer (default 4)")
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="qwen3_moe, mixtral: experts per token (default 2); --ffn is each expert's width",
    )
    p.add_argument(
        "--first-dense", type=int, default=None, help="glm4_moe, deepseek_v3: dense first layers (default 1)"
    )
    p.add_argument("--shared-experts", type=int, default=None, help="glm4_moe, deepseek_v3: shared experts (default 1)")
    p.add_argument(
        "--moe-ffn", type=int, default=None, help="glm4_moe, deepseek_v3: each expert's width (default --ffn / 2)"
    )
    p.add_argument(
        "--q-lora-rank", type=int, default=None, help="deepseek_v3: the q latent (default 20; 0: null, one q_proj)"
    )
    p.add_argument("--kv-lora-rank", type=int, default=None, help="deepseek_v3: the kv latent (default 18)")
    p.add_argument("--qk-nope-dim", type=int, default=None, help="deepseek_v3: per-head q/k dims without RoPE (10)")
    p.add_argument("--qk-rope-dim", type=int, default=None, help="deepseek_v3: per-head RoPE dims (default 6)")
    p.add_argument("--v-head-dim", type=int, default=None, help="deepseek_v3: per-head value dims (default 14)")
    p.add_argument("--yarn", action="store_true", default=None, help="deepseek_v3: YaRN RoPE (factor 4)")
    p.add_argument(
        "--routed-scaling-factor", type=float, default=None, help="glm4_moe, deepseek_v3: routed weights x this"
    )
    p.add_argument("--qk-norm", action="store_true", default=None, help="glm4_moe: q/k RMSNorm (use_qk_norm)")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    quiet_console()  # the libraries' warnings and progress bars, as in a training run
    try:
        options = {
            k: v
            for k, v in (
                ("head_dim", a.head_dim),
                ("sliding_window", a.sliding_window),
                ("experts", a.experts),
                ("top_k", a.top_k),
                ("first_dense", a.first_dense),
                ("shared_experts", a.shared_experts),
                ("moe_ffn", a.moe_ffn),
                ("qk_norm", a.qk_norm),
                ("kv_lora_rank", a.kv_lora_rank),
                ("qk_nope_head_dim", a.qk_nope_dim),
                ("qk_rope_head_dim", a.qk_rope_dim),
                ("v_head_dim", a.v_head_dim),
                ("yarn", a.yarn),
                ("routed_scaling_factor", a.routed_scaling_factor),
            )
            if v is not None
        }
        if a.q_lora_rank is not None:  # 0 stands for null (DeepSeek-V2-Lite's one q projection)
            options["q_lora_rank"] = a.q_lora_rank or None
        out = make_tiny_model(
            a.out,
            a.family,
            a.hidden,
            a.layers,
            a.heads,
            a.kv_heads,
            a.ffn,
            a.vocab,
            a.tie,
            a.reward,
            a.rope_theta,
            a.max_positions,
            a.dtype,
            a.seed,
            a.overwrite,
            **options,
        )
    except (ValueError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
