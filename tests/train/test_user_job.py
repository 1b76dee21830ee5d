"""A user's own job through the real trainer (one process, native engine, a tiny random Llama whose tokenizer
has a Jinja chat template), in one build: TRL conversational data (message-list prompts) and TRL-style reward
functions, unchanged; per-function eval rewards and eval samples that show the answer and the reward and move
through the eval set; Hugging Face exports while training (checkpoint.hf_every) whose config.json states the
tensors' dtype (bfloat16 here, over a float32 source config)."""

import json
import os

import pytest
import torch

from tests._dist import run_distributed
from tools.make_tiny_model import make_tiny_model

QUESTIONS = [(f"What is {a}+{b}?", str(a + b)) for a in range(4) for b in range(4)]


def _job_body(rank, world, model_dir, data, out_dir, result_path):
    from remax_megatron.config import load_config
    from remax_megatron.startup import build, check_inputs
    from remax_megatron.trainer import Trainer
    from tests.reward import trl_rewards

    cfg = load_config(
        None,
        [
            f"actor.model={model_dir}",
            "actor.dtype=bfloat16",
            "rollout.engine=native",
            "rollout.n=2",
            "rollout.max_new_tokens=4",
            f"data.train={data}",
            "data.eval_size=6",
            "data.max_prompt_tokens=64",
            "reward.functions=[tests.reward.trl_rewards:accuracy,tests.reward.trl_rewards:short]",
            "reward.weights=[1.0,0.5]",
            "trainer.prompts_per_step=2",
            "trainer.micro_batch_size=4",
            "trainer.steps=2",
            "trainer.eval_every=1",
            "trainer.eval_prompts=6",
            "logging.sample_completions=2",
            "checkpoint.save_every=0",
            "checkpoint.hf_every=1",
            "checkpoint.keep=1",
            f"trainer.output_dir={out_dir}",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
            "optim.lr=1e-3",
        ],
    )
    checked = check_inputs(cfg, world)
    parts = build(cfg, checked)
    seen_prompts = []
    generate = parts.engine.generate

    def spy_generate(prompts, n, sampling, seeds=None):
        seen_prompts.extend(prompts)
        return generate(prompts, n=n, sampling=sampling, seeds=seeds)

    parts.engine.generate = spy_generate

    class Log:
        lines, records = [], []

        def write(self, text):
            self.lines.append(text)

        def log(self, record):
            self.records.append(record)

        def progress(self, step, record):
            pass

    log = Log()
    trainer = Trainer(parts, log)
    trl_rewards.calls.clear()
    trainer.fit()
    tok = parts.tokenizer
    torch.save(
        {
            "records": log.records,
            "lines": log.lines,
            "calls": trl_rewards.calls,
            "prompts": [(q.raw, q.token_ids, q.columns["answer"]) for q in checked.train + checked.eval],
            "expected": [
                tok.apply_chat_template(q.raw, add_generation_prompt=True)["input_ids"]
                for q in checked.train + checked.eval
            ],
            "seen": seen_prompts,
            "decoded": {},
        },
        result_path,
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("job")
    model = make_tiny_model(str(tmp / "llama"), "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, seed=7)
    data = tmp / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": q}],
                    "answer": a,
                }
            )
            + "\n"
            for q, a in QUESTIONS
        )
    )
    run_distributed(_job_body, world_size=1, args=(model, str(data), str(tmp / "out"), str(tmp / "job.pt")))
    return torch.load(tmp / "job.pt", weights_only=False), tmp / "out"


@pytest.mark.slow
def test_conversational_prompts_reach_the_engine_through_the_chat_template(job):
    result, _ = job
    assert [ids for _, ids, _ in result["prompts"]] == result["expected"]
    known = {tuple(ids) for _, ids, _ in result["prompts"]}
    assert result["seen"] and all(tuple(p) in known for p in result["seen"])


@pytest.mark.slow
def test_trl_style_reward_functions_train_unchanged(job):
    """`accuracy(completions, answer, **kwargs)` gets TRL's keywords: the conversations as `prompts`, chat-format
    completions, their ids, the answer column; the step's metrics carry each function's mean."""
    result, _ = job
    conversations = [raw for raw, _, _ in result["prompts"]]
    train_calls = [c for c in result["calls"] if len(c["completions"]) > 2]
    assert train_calls
    for call in result["calls"]:
        assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in call["completions"])
        assert all(p in conversations for p in call["prompts"])
        assert len(call["completion_ids"]) == len(call["completions"]) and "answer" in call
    records = [r for r in result["records"] if "loss" in r]
    assert len(records) == 2 and all("reward/accuracy_mean" in r and "reward/short_mean" in r for r in records)
    for r in records:  # the weighted sum of the two functions
        assert r["reward/sampled_mean"] <= 1.0 and r["reward/short_mean"] < 0


@pytest.mark.slow
def test_eval_logs_each_function_and_samples_rotate_with_answer_and_reward(job):
    result, _ = job
    evals = [r for r in result["records"] if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in evals:
        assert r["eval/reward_mean"] == pytest.approx(
            r["eval/reward/accuracy_mean"] + 0.5 * r["eval/reward/short_mean"]
        )
    samples = [line for line in result["lines"] if line.startswith("  [eval step")]
    assert len(samples) == 6 and all("(answer '" in line and ", reward " in line for line in samples), samples
    shown = [
        [line.split("] ", 1)[1].split(" -> ")[0] for line in samples if line.startswith(f"  [eval step {s}]")]
        for s in range(3)
    ]
    assert len({q for step in shown for q in step}) == 6, shown  # each eval shows the next two of the six


@pytest.mark.slow
def test_hf_exports_while_training_state_their_dtype(job):
    """checkpoint.hf_every=1 with keep=1: the last step's export remains, written through the converter's path,
    loadable by transformers, its config.json saying bfloat16 (the source's said float32)."""
    _, out = job
    assert sorted(os.listdir(out / "hf")) == ["step_000002"]
    export = out / "hf" / "step_000002"
    with open(export / "config.json") as f:
        config = json.load(f)
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    from safetensors.torch import load_file

    tensors = load_file(export / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.dtype == torch.bfloat16
    assert os.path.isfile(export / "tokenizer_config.json") or os.path.isfile(export / "tokenizer.json")
