"""The peer of tools/bench_e2e.py: TRL's GRPOTrainer on the work described by a spec file.

    python tools/bench_e2e_trl.py --spec spec.json --generation vllm|transformers --out peer.json

Run by `bench_e2e.py --peer trl` (one process, world 1) with a python that can import trl;
not a project dependency. The spec (bench_e2e.peer_spec) gives the model, the prompt rows,
n, max new tokens, sampling, lr, micro-batch size and the reward functions; the run uses
the project's reward functions (remax_megatron.reward.RewardFunctions) so both sides score
the same way.

Configuration (the same work as ours, in TRL's fastest setting that runs on CPU):
beta=0 (no reference model), one generation and one optimizer step per prompts_per_step *
n completions (gradient accumulation over micro-batches of our size), the precision of ours
(actor.dtype float32: bf16=False; bfloat16: bf16=True, TRL's mixed precision: fp32 weights and
AdamW, bf16 autocast around every forward, generation included), no gradient checkpointing, no
importance-sampling correction (it costs an extra forward; ours has none either). Generation:
vLLM colocate (`--generation vllm`) with a KV cache of the spec's size, or transformers generate.

Stop tokens (the spec's stop_token_ids, bench_e2e.py --stop-every): the model is given to TRL
from a directory whose generation_config.json lists them beside EOS as `eos_token_id` (links to
the same weights), so TRL's generation stops there and its completion masks end there, as ours.

Seconds per step: the wall time between consecutive optimizer steps (on_step_end), so
generation, rewards, forward/backward and TRL's own bookkeeping all count. launch_to_first_step_s: from
this process's start to the end of the first optimizer step; peak_memory: GPU (torch's allocator) and
host RSS peaks, GiB.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_reward(spec: dict, columns: list[str]):
    """The project's weighted reward functions with TRL's reward-function signature."""
    from remax_megatron.reward import RewardFunctions

    functions = RewardFunctions(spec["reward_functions"], spec["reward_weights"], spec["reward_options"])

    def remax_reward(prompts, completions, **kwargs):
        total, _ = functions(
            list(prompts), list(completions), {k: list(kwargs[k]) for k in columns}, list(range(len(prompts)))
        )
        return total

    remax_reward.__name__ = "+".join(spec["reward_functions"])
    return remax_reward


def with_stop_tokens(hf_dir: str, stop_ids: list[int], tokenizer) -> str:
    """`hf_dir` itself without stop ids; else a temporary directory linking its files, whose
    generation_config.json has eos_token_id = EOS + stop_ids."""
    if not stop_ids:
        return hf_dir
    out = tempfile.mkdtemp(prefix="bench-e2e-trl-model-")
    for name in os.listdir(hf_dir):
        if name != "generation_config.json":
            os.symlink(os.path.join(os.path.abspath(hf_dir), name), os.path.join(out, name))
    path = os.path.join(hf_dir, "generation_config.json")
    config = json.load(open(path)) if os.path.exists(path) else {}
    eos = config.get("eos_token_id", tokenizer.eos_token_id)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    config["eos_token_id"] = eos + [t for t in stop_ids if t not in eos]
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(config, f)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True)
    p.add_argument("--generation", choices=["vllm", "transformers"], required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tools.bench_e2e import peak_memory, seconds_since_launch

    rows = spec["rows"]
    columns = [k for k in rows[0] if k != "prompt"]
    samples = spec["prompts_per_step"] * spec["n"]
    mbs = spec["micro_batch_size"]
    if samples % mbs:
        raise ValueError(f"prompts_per_step * n = {samples} is not divisible by micro_batch_size={mbs}")
    use_vllm = args.generation == "vllm"
    bf16 = spec["dtype"] == "bfloat16"  # float32 or bfloat16 (bench_e2e.check_peer); see the docstring
    config = dict(
        per_device_train_batch_size=mbs,
        gradient_accumulation_steps=samples // mbs,
        num_generations=spec["n"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=spec["top_k"],
        learning_rate=spec["lr"],
        max_grad_norm=spec["grad_clip"] or 1e9,
        weight_decay=spec["weight_decay"],
        lr_scheduler_type="constant",
        beta=0.0,
        num_iterations=1,
        max_steps=spec["steps"],
        seed=spec["seed"],
        bf16=bf16,
        gradient_checkpointing=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_vllm=use_vllm,
    )
    if use_vllm:
        # vLLM's CPU build sizes the KV cache as (memory fraction x host memory - this process's RSS), which
        # a training process overdraws; its own CPU knob sets the size instead (whole GiB, >= ours).
        kv_gib = max(1, math.ceil(spec["kv_cache_gib"]))
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
        config.update(
            vllm_mode="colocate",
            vllm_importance_sampling_correction=False,
            vllm_max_model_length=spec["max_prompt_tokens"] + spec["max_new_tokens"],
        )
    out_dir = tempfile.mkdtemp(prefix="bench-e2e-trl-")
    grpo_args = GRPOConfig(output_dir=out_dir, **config)

    step_ends: list[float] = []
    first_step = [None]  # process start to the end of the first optimizer step
    cpu_ends: list[float] = []  # process CPU seconds at the same points
    history: list[dict] = []  # TRL's log records (completion lengths, rewards)
    generating: list[float] = [0.0]  # seconds in GRPOTrainer._generate (weight sync + decoding) per step

    class StepClock(TrainerCallback):
        def on_train_begin(self, *_a, **_k):
            step_ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

        def on_step_end(self, *_a, **_k):
            if len(step_ends) == 1:
                first_step[0] = seconds_since_launch()
            step_ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
            generating.append(0.0)

        def on_log(self, _args, _state, _control, logs=None, **_k):
            if logs:
                history.append(dict(logs))

    tokenizer = AutoTokenizer.from_pretrained(spec["hf_dir"])
    model_dir = with_stop_tokens(spec["hf_dir"], spec.get("stop_token_ids") or [], tokenizer)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=make_reward(spec, columns),
        args=grpo_args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    build_s = time.perf_counter() - t0
    generate = getattr(trainer, "_generate", None)  # TRL 1.x: the rollout of one generation batch
    if generate is not None:

        def timed_generate(*a, **k):
            start = time.perf_counter()
            try:
                return generate(*a, **k)
            finally:
                generating[-1] += time.perf_counter() - start

        trainer._generate = timed_generate
    trainer.train()
    step_s = [b - a for a, b in zip(step_ends, step_ends[1:])][spec["warmup"] :]
    if not step_s:
        raise RuntimeError(f"TRL ran {len(step_ends) - 1} steps, none after the {spec['warmup']} warm-up steps")
    cpu_s = [b - a for a, b in zip(cpu_ends, cpu_ends[1:])][spec["warmup"] :]
    lengths = [entry["completions/mean_length"] for entry in history if "completions/mean_length" in entry]
    result = {
        "samples_per_s": samples / statistics.median(step_s),
        "step_s": step_s,
        # Per measured step: seconds generating (TRL's _generate) and the rest (rewards, forward/backward,
        # optimizer, bookkeeping); None where this TRL has no _generate.
        "generation_s": generating[spec["warmup"] : len(step_s) + spec["warmup"]] if generate is not None else None,
        "cpu_s_per_step": statistics.median(cpu_s),
        "cpu_s_per_sample": statistics.median(cpu_s) / samples,
        "build_s": build_s,
        "launch_to_first_step_s": first_step[0],
        "peak_memory": peak_memory(),
        "response_length_mean": statistics.median(lengths[spec["warmup"] :] or lengths) if lengths else None,
        "config": {
            "trainer": "trl.GRPOTrainer",
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "generation": "vllm colocate" if use_vllm else "transformers generate",
            "threads": torch.get_num_threads(),
            "weights_dtype": str(trainer.model.dtype).replace("torch.", ""),
            "stop_token_ids": len(trainer.eos_token_ids),
            **{k: v for k, v in config.items() if k != "report_to"},
        },
    }
    if use_vllm:
        import vllm

        result["config"].update(vllm=vllm.__version__, VLLM_CPU_KVCACHE_SPACE=kv_gib)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
