"""The typed config tree: YAML files and dotted `key=value` overrides fill it; checks live here.

    cfg = load_config("configs/tiny_cpu.yaml", ["actor.tp=2", "trainer.steps=10"])

Every field has a type; YAML values and command-line strings are converted to it
(a wrong type is an error naming the key). Unknown keys are refused with a
"did you mean" suggestion. `__post_init__` checks each section alone;
`check_world` checks the layout against the launched world size.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Literal

import yaml

from remax_megatron.sizes import check_token_budget, round_up, sequence_multiple

# Fixed choices: the type is the one source of the allowed values (checked on load, listed by --help).
Recompute = Literal["none", "selective", "full"]
KlMode = Literal["reward", "loss"]
KlEstimator = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
Schedule = Literal["constant", "linear", "cosine"]
Overlong = Literal["drop", "truncate"]
Dtype = Literal["float32", "bfloat16", "float16"]
Compile = Literal["auto", "always", "never"]
ScoredTurns = Literal["all", "last"]
MoeDispatcher = Literal["alltoall", "allgather"]
MoeExperts = Literal["auto", "grouped", "sequential"]
MoeAuxLoss = Literal["aux", "seq_aux", "none"]
LogLevel = Literal["debug", "info", "warning", "error"]
RolloutCorrection = Literal["none", "token-tis", "seq-mis"]  # algo/rollout_correction.py
Placement = Literal["colocated", "separate"]  # parallel/split.py, rollout/remote.py
SkipMode = Literal["auto", "on", "off"]  # algo/zero_advantage.py
# megatron's names of the linears LoRA may adapt: attention q/k/v (fused) and output, MLP fc1 (gate; up) and fc2
# megatron's linear names; the linear_q*/linear_kv* ones are multi-latent attention's (DeepSeek-V3), which has no
# linear_qkv (linear_q_proj where q_lora_rank is null, else linear_q_down_proj / linear_q_up_proj)
LoraTarget = Literal[
    "linear_qkv",
    "linear_proj",
    "linear_fc1",
    "linear_fc2",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
]
DEFAULT_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def knob(default, doc: str):
    """A config field with its documentation (shown by `python -m remax_megatron.train --help`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def _auto_or_positive(key: str, value: str) -> None:
    """`value` is "auto" or a number > 0 (a str field that takes either)."""
    if str(value).strip().lower() == "auto":
        return
    try:
        ok = float(value) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{key}={value!r} must be auto or a number > 0")


def _check_choices(section: str, obj) -> None:
    """Every Literal-typed field of `obj` holds one of its allowed values."""
    for name, hint in typing.get_type_hints(type(obj)).items():
        if typing.get_origin(hint) is Literal and getattr(obj, name) not in typing.get_args(hint):
            raise ValueError(
                f"{section}.{name}={getattr(obj, name)!r} is not one of {', '.join(typing.get_args(hint))}"
            )


def _positive(key: str, value, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{key}={value!r} must be {'>= 0' if zero_ok else '> 0'}")


@dataclass
class TrainerConfig:
    steps: int = knob(20, "total optimizer steps of the run (a resumed run continues up to it)")
    seed: int = knob(0, "seeds data order, sampling and init on every rank")
    output_dir: str = knob("outputs/run", "metrics.jsonl, config.yaml, TensorBoard events, checkpoints")
    prompts_per_step: int = knob(8, "global prompts per step (each gets rollout.n samples + 1 greedy)")
    micro_batch_size: int = knob(
        4, "sequences per micro-batch in the train forward/backward (trainer.micro_batch_tokens=0)"
    )
    micro_batch_tokens: int = knob(
        0,
        "token budget of a micro-batch, padding included: rows grouped under it, each "
        "micro-batch padded to its own longest row, DP ranks given near-equal tokens; "
        "0: micro_batch_size rows per micro-batch, all as long as the step's longest",
    )
    pack_sequences: bool = knob(
        False,
        "several sequences per row, attention kept inside each (megatron's THD format: "
        "each document attended alone); needs trainer.micro_batch_tokens",
    )
    mini_batches: int = knob(1, "optimizer steps per rollout (> 1 uses the clipped ratio)")
    eval_every: int = knob(5, "greedy eval every N steps (0: never)")
    eval_prompts: int = knob(32, "held-out prompts evaluated")
    dist_timeout_minutes: int = knob(30, "collective timeout: a dead rank fails the job after this")
    peak_tflops: float = knob(0.0, "device peak for perf/mfu; 0: from the GPU's name (H100/H200/A100/L40S)")
    no_signal_steps: int = knob(
        10,
        "warn once when every sample tied with its greedy reward (no learning signal) "
        "this many steps in a row (0: never)",
    )
    skip_zero_advantage: SkipMode = knob(
        "auto",
        "leave rows with advantage 0 at every token (reward equal to the "
        "greedy one) out of the update's forward and backward; the loss's global "
        "token count still counts them, so the update is unchanged. auto: on "
        "exactly when nothing else gives those rows a gradient (KL, a MoE "
        "load-balancing loss, LoRA dropout), else off and said at start",
    )
    mask_truncated: bool = knob(
        False,
        "a sample cut at rollout.max_new_tokens is left out of the loss (and its "
        "token count); still scored, logged and used as a baseline",
    )

    def __post_init__(self):
        _check_choices("trainer", self)
        for key in ("steps", "prompts_per_step", "micro_batch_size", "mini_batches"):
            _positive(f"trainer.{key}", getattr(self, key))
        for key in ("eval_every", "eval_prompts"):
            _positive(f"trainer.{key}", getattr(self, key), zero_ok=True)
        _positive("trainer.dist_timeout_minutes", self.dist_timeout_minutes)
        _positive("trainer.micro_batch_tokens", self.micro_batch_tokens, zero_ok=True)
        if self.pack_sequences and not self.micro_batch_tokens:
            raise ValueError(
                "trainer.pack_sequences=true needs a token budget: set trainer.micro_batch_tokens (e.g. "
                "4096) or trainer.pack_sequences=false"
            )
        _positive("trainer.peak_tflops", self.peak_tflops, zero_ok=True)
        _positive("trainer.no_signal_steps", self.no_signal_steps, zero_ok=True)


@dataclass
class ActorConfig:
    model: str = knob("", "Hugging Face model directory (config.json + safetensors)")
    tp: int = knob(1, "tensor-parallel size")
    pp: int = knob(1, "pipeline-parallel size")
    dtype: Dtype = knob("float32", "parameter dtype (the engine runs in it too)")
    sequence_parallel: bool = knob(False, "shard activations along the sequence within TP (GPU)")
    recompute: Recompute = knob("none", "activation recompute (megatron's granularity)")
    make_vocab_size_divisible_by: int = knob(128, "vocab padded to a multiple of this * tp")
    offload_during_rollout: bool = knob(False, "params, grads, optimizer state to host while the engine generates")
    ep: int = knob(1, "MoE: expert-parallel size (experts split over this many ranks, carved from tp x dp)")
    etp: int = knob(0, "MoE: expert tensor-parallel size, 1 (experts whole) or actor.tp; 0: actor.tp")
    moe_dispatcher: MoeDispatcher = knob("alltoall", "MoE: megatron's token dispatcher")
    moe_experts: MoeExperts = knob(
        "auto",
        "MoE: grouped = Transformer Engine's grouped GEMM (CUDA), sequential = "
        "megatron's SequentialMLP; auto = grouped where TE runs, else sequential",
    )
    lora_rank: int = knob(
        0,
        "LoRA rank of the actor's adapters (0: off, full fine-tuning); > 0: only the adapters "
        "train, and with KL the reference is the actor with its adapters off (no second model)",
    )
    lora_alpha: float = knob(16.0, "LoRA scale numerator: the adapter adds (lora_alpha / lora_rank) * B A x")
    lora_targets: list[LoraTarget] = knob(
        list(DEFAULT_LORA_TARGETS),
        "linears that get adapters (megatron names, in every decoder layer; MoE experts are refused; "
        "multi-latent attention has linear_q*/linear_kv* in place of linear_qkv)",
    )
    lora_dropout: float = knob(0.0, "dropout on the adapters' input (training forward only)")

    def __post_init__(self):
        _positive("actor.tp", self.tp)
        _positive("actor.pp", self.pp)
        _positive("actor.ep", self.ep)
        _positive("actor.etp", self.etp, zero_ok=True)
        _check_choices("actor", self)
        _positive("actor.make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        _positive("actor.lora_rank", self.lora_rank, zero_ok=True)
        if self.lora_rank:
            self._check_lora()

    def _check_lora(self) -> None:
        _positive("actor.lora_alpha", self.lora_alpha)
        allowed = typing.get_args(LoraTarget)
        unknown = [t for t in self.lora_targets if t not in allowed]
        if unknown or not self.lora_targets:
            raise ValueError(
                f"actor.lora_targets={self.lora_targets} "
                f"{f'holds unknown {unknown}' if unknown else 'is empty'}: choose from {list(allowed)}"
            )
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"actor.lora_dropout={self.lora_dropout!r} must be in [0, 1)")
        if self.lora_dropout and self.tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"actor.lora_dropout={self.lora_dropout} with actor.tp={self.tp} is not supported without "
                "sequence parallel (the TP ranks would draw different masks for the replicated input): "
                "set actor.lora_dropout=0 or actor.sequence_parallel=true"
            )


@dataclass
class ReferenceConfig:
    enabled: bool = knob(
        False,
        "build a frozen reference model (needed for algo.kl_coef > 0; with actor.lora_rank > 0 "
        "none is built: the reference is the actor with its adapters off)",
    )
    model: str = knob("", "default: actor.model (the reference is the initial policy)")


@dataclass
class RewardConfig:
    functions: list[str] = knob([], 'registry names or "package.module:function"')
    weights: list[float] = knob([], "one per function (default 1.0 each)")
    model: str = knob("", "optional reward-model directory (*ForSequenceClassification)")
    model_weight: float = knob(1.0, "weight of the reward-model score in the sum")
    tp: int = knob(1, "reward-model tensor parallel (see reward.pp for the layouts allowed)")
    pp: int = knob(
        1,
        "reward-model pipeline parallel; reward.tp * reward.pp divides actor.tp * actor.pp, or is a "
        "multiple of it that divides the world size",
    )
    format_pattern: str = knob(r"^\s*-?\d+\s*$", "regex of the built-in `format` reward")
    numeric_tolerance: float = knob(1e-6, "relative tolerance of the built-in `numeric_match`")
    length_limit: int = knob(256, "chars before the built-in `length_penalty` starts")
    overlong_buffer: int = knob(
        0,
        "DAPO's overlong shaping: the last this many tokens before rollout.max_new_tokens "
        "get a linear penalty, 0 at the buffer's start to -reward.overlong_penalty at the "
        "limit, added to samples and greedy alike (0: off)",
    )
    overlong_penalty: float = knob(1.0, "the overlong shaping's penalty at the length limit (reward.overlong_buffer)")
    workers: int = knob(
        0,
        "worker processes per rank that call reward.functions, one response per call (a hang or "
        "crash costs only its response); 0: called in the trainer's process, once per batch",
    )
    timeout_s: float = knob(
        0.0,
        "reward.workers: a call running longer is killed with its worker and its response "
        "scores reward.timeout_value (0: no limit; a worker that dies scores it too)",
    )
    timeout_value: float = knob(
        0.0, "the reward of a response whose call timed out or whose worker died (metric reward/timeouts counts them)"
    )
    turns: ScoredTurns = knob(
        "all",
        "multi-turn rollouts: the text reward.functions score; all: the transcript (every turn and "
        "observation), last: the final assistant turn only (a tool's output cannot pass as the answer)",
    )

    def __post_init__(self):
        if self.weights and len(self.weights) != len(self.functions):
            raise ValueError(
                f"reward.weights has {len(self.weights)} values for {len(self.functions)} "
                "reward.functions: give one weight per function or none"
            )
        _check_choices("reward", self)
        _positive("reward.tp", self.tp)
        _positive("reward.pp", self.pp)
        _positive("reward.numeric_tolerance", self.numeric_tolerance, zero_ok=True)
        _positive("reward.length_limit", self.length_limit)
        _positive("reward.overlong_buffer", self.overlong_buffer, zero_ok=True)
        _positive("reward.overlong_penalty", self.overlong_penalty, zero_ok=True)
        _positive("reward.workers", self.workers, zero_ok=True)
        _positive("reward.timeout_s", self.timeout_s, zero_ok=True)
        if not math.isfinite(self.timeout_value):
            raise ValueError(f"reward.timeout_value={self.timeout_value} is not a finite number: give one, e.g. 0.0")
        # In-process, a hung call cannot be stopped (an alarm does not interrupt C code, a crash ends the rank).
        if self.timeout_s > 0 and self.workers == 0:
            raise ValueError(
                f"reward.timeout_s={self.timeout_s} needs reward.workers >= 1 (only a call in a worker "
                "process can be stopped): set reward.workers, or reward.timeout_s=0"
            )
        if self.workers and not self.functions:
            raise ValueError(
                f"reward.workers={self.workers} runs reward.functions, and there are none: set "
                "reward.functions, or reward.workers=0"
            )


@dataclass
class RolloutConfig:
    engine: str = knob(
        "vllm",
        "a registered rollout engine (remax_megatron/rollout/factory.py): vllm (CUDA, or "
        "vLLM's CPU build) | native (no vLLM needed)",
    )
    n: int = knob(2, "sampled responses per prompt; the greedy one comes on top")
    tp: int = knob(1, "inference tensor parallel (may differ from actor.tp)")
    temperature: float = knob(1.0, "sampling temperature of the n samples (greedy is argmax)")
    top_p: float = knob(1.0, "nucleus sampling: keep the smallest token set with this probability mass (1: off)")
    top_k: int = knob(0, "sample from the k most likely tokens (0: off)")
    max_new_tokens: int = knob(
        64, "completion length limit (sampled and greedy); prompt + this <= max_position_embeddings"
    )
    stop: list[str] = knob([], "stop strings (EOS always stops)")
    stop_token_ids: list[int] = knob([], "token ids that end a completion as EOS does (kept in it)")
    sync_bucket_mb: int = knob(256, "weight-sync bucket size in MiB (peak extra memory of the sync)")
    kv_cache_gib: float = knob(
        0.0,
        "KV cache per engine in GiB; 0: vLLM sized by gpu_memory_utilization, the native engine one static cache "
        "per request (prompt + max_new_tokens for every row); native > 0: a request that needs more decodes in "
        "waves of the rows that fit",
    )
    gpu_memory_utilization: float = knob(
        0.5, "vLLM's memory fraction when kv_cache_gib=0 (CPU: of HOST memory, per engine)"
    )
    logprob_warn_threshold: str = knob(
        "auto",
        "when the engine-vs-actor log-prob gap warns: auto = the gap of the first steps after a sync (>= 100 "
        "tokens; the floor of the run's dtype: ~1e-7 mean in fp32, ~5e-3 in bf16) measured, then a step whose "
        "mean |diff| exceeds 3x the floor's mean + 4 standard errors (at least 1e-5) warns, naming the floor "
        "(rollout/monitor.py MismatchFloor); a number = warn when the max |diff| exceeds it (fixed)",
    )
    compile: Compile = knob(
        "auto",
        "vLLM's torch.compile of the model: auto = on CUDA (with CUDA graphs), eager on "
        "CPU; always = on CPU too (~25 s more start-up, ~10% faster decoding on a 60M model); "
        "never = eager everywhere",
    )
    routing_replay: bool = knob(
        False,
        "MoE: the actor's training forward routes each sampled token to the experts "
        "the engine chose (router probabilities from the live router); the native engine, or "
        "vLLM on CUDA (its CPU build cannot return the routes)",
    )
    guided_regex: str = knob(
        "",
        "guided decoding: every sampled AND greedy response matches this regex (vLLM's "
        "structured outputs, xgrammar); vLLM only",
    )
    guided_json: str = knob(
        "",
        "guided decoding: every sampled and greedy response is JSON matching this JSON "
        "schema (JSON text; in YAML a quoted string); vLLM only",
    )
    placement: Placement = knob(
        "colocated",
        "colocated: every rank trains and runs an engine, one after the "
        "other; separate: the last rollout.ranks ranks run the engine(s), the others train, "
        "weights go over by broadcast",
    )
    ranks: int = knob(
        0, "rollout.placement=separate: how many ranks of the world run the engine(s) (rollout.tp divides it)"
    )
    behaviour_logprobs: bool = knob(
        False,
        "rollout.placement=separate with max_staleness=1: also compute each "
        "batch's log-probs under the actor version that generated it (one more copy of "
        "the actor's weights and one more forward per step): the metric "
        "logprob/engine_vs_behaviour_max_diff, the engine's own mismatch without the lag",
    )
    max_staleness: int = knob(
        1,
        "rollout.placement=separate: 1 = the rollout ranks generate step k+1 with the "
        "weights step k started from while the training ranks update on step k (one policy "
        "version behind; use algo.rollout_correction); 0 = they wait for the update",
    )

    env: str = knob(
        "",
        "multi-turn rollouts: package.module:Factory, an environment per trajectory built from the dataset "
        "row's columns (rollout/agent.py; docs/guide.md, Environments); empty: single-turn",
    )
    max_turns: int = knob(1, "rollout.env: assistant turns per trajectory at most")
    max_total_tokens: int = knob(
        0, "rollout.env: prompt + every turn + observations at most, in tokens (required with rollout.env)"
    )
    env_timeout_s: float = knob(
        60.0, "rollout.env: a step() or reward() call longer than this ends its trajectory (env_error); 0: no limit"
    )
    tools: list[str] = knob(
        [],
        "multi-turn rollouts with tools (remax_megatron/agent/tools.py): package.module:function or builtin:python, "
        "builtin:calculator; a turn's calls run and their results are the next tool messages; a turn without "
        "a call ends the trajectory",
    )
    tool_parser: str = knob(
        "hermes",
        "rollout.tools: how calls are read from the assistant's text: hermes (Qwen2.5 / Qwen3), llama3_json "
        "(Llama 3.1-3.3) or mistral (Mistral / Mixtral instruct models: [TOOL_CALLS])",
    )
    tool_timeout_s: float = knob(10.0, "rollout.tools: a call longer than this gives the model an error text")
    tool_max_output_chars: int = knob(
        8192, "rollout.tools: a result longer than this keeps its head and tail around a note of what was cut"
    )

    @property
    def multi_turn(self) -> bool:
        """Trajectories through an environment: rollout.env or rollout.tools."""
        return bool(self.env or self.tools)

    def __post_init__(self):
        _check_choices("rollout", self)
        if not self.engine:
            raise ValueError("rollout.engine is empty: use vllm or native")
        _positive("rollout.n", self.n)
        _positive("rollout.tp", self.tp)
        _positive("rollout.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p!r} must be in (0, 1]")
        _positive("rollout.top_k", self.top_k, zero_ok=True)
        _positive("rollout.max_new_tokens", self.max_new_tokens)
        if self.max_staleness not in (0, 1):
            raise ValueError(
                f"rollout.max_staleness={self.max_staleness!r} must be 0 or 1 (policy versions the "
                "rollout may lag behind the update)"
            )
        if self.placement == "separate" and self.ranks < 1:
            raise ValueError(
                f"rollout.placement=separate with rollout.ranks={self.ranks}: give the number of ranks "
                "that run the engine(s), e.g. rollout.ranks=1"
            )
        if self.placement == "colocated" and self.ranks:
            raise ValueError(
                f"rollout.ranks={self.ranks} with rollout.placement=colocated: every rank runs an engine "
                "there; set rollout.placement=separate or rollout.ranks=0"
            )
        if self.behaviour_logprobs and (self.placement != "separate" or self.max_staleness != 1):
            raise ValueError(
                "rollout.behaviour_logprobs=true needs rollout.placement=separate with "
                "rollout.max_staleness=1 (otherwise the batch's policy is the actor's: "
                "logprob/engine_vs_actor_max_diff says it already)"
            )
        _positive("rollout.max_turns", self.max_turns)
        _positive("rollout.env_timeout_s", self.env_timeout_s, zero_ok=True)
        if self.env and self.tools:
            raise ValueError(
                "rollout.env and rollout.tools are both set: rollout.tools is an environment of its own; give "
                "your environment its tools, or unset rollout.env"
            )
        _positive("rollout.tool_timeout_s", self.tool_timeout_s, zero_ok=True)
        if self.tool_max_output_chars < 128:
            raise ValueError(
                f"rollout.tool_max_output_chars={self.tool_max_output_chars!r} leaves no room for a result and "
                "the note of what was cut: give at least 128, e.g. rollout.tool_max_output_chars=8192"
            )
        if self.multi_turn and self.routing_replay:
            raise ValueError(
                "rollout.env with rollout.routing_replay=true: the routes of observation tokens are not "
                "recorded across turns yet; set rollout.routing_replay=false"
            )
        if self.multi_turn and not self.max_total_tokens:
            raise ValueError(
                f"rollout.{'env' if self.env else 'tools'} is set but rollout.max_total_tokens=0: give the longest "
                "trajectory in tokens "
                "(prompt + every turn + observations), e.g. rollout.max_total_tokens=1024"
            )
        if not self.multi_turn and (self.max_turns != 1 or self.max_total_tokens):
            raise ValueError(
                f"rollout.max_turns={self.max_turns} / rollout.max_total_tokens={self.max_total_tokens} without "
                "rollout.env: multi-turn rollouts need an environment (rollout.env=package.module:Factory) or "
                "tools (rollout.tools)"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"rollout.stop_token_ids={self.stop_token_ids} holds a negative id: token ids are >= 0")
        _auto_or_positive("rollout.logprob_warn_threshold", self.logprob_warn_threshold)
        _positive("rollout.sync_bucket_mb", self.sync_bucket_mb)
        _positive("rollout.kv_cache_gib", self.kv_cache_gib, zero_ok=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if self.guided_regex and self.guided_json:
            raise ValueError(
                "rollout.guided_regex and rollout.guided_json are both set: guided decoding takes one "
                "constraint; unset one of them"
            )
        if self.guided_json:
            try:
                schema = json.loads(self.guided_json)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"rollout.guided_json is not valid JSON ({e.msg} at character {e.pos + 1}): give a "
                    "JSON schema as JSON text"
                ) from None
            if not isinstance(schema, dict):
                raise ValueError(
                    f"rollout.guided_json={self.guided_json!r} is not a JSON object: give a JSON schema, "
                    'e.g. {"type": "object", "properties": {...}}'
                )


@dataclass
class AlgoConfig:
    kl_coef: float = knob(0.0, "KL penalty coefficient (0: no reference needed)")
    kl_mode: KlMode = knob("reward", "reward: per-token k1 penalty in the reward; loss: a loss term (kl_estimator)")
    kl_estimator: KlEstimator = knob(
        "k3",
        "estimator of the kl_mode=loss term; k1 is refused there (its gradient "
        "has zero expectation on-policy); the kl/mean metric is always k1",
    )
    kl_target: float = knob(0.0, "> 0: adaptive KL coefficient towards this KL per sequence")
    kl_horizon: int = knob(10000, "adaptive controller horizon (in sequences)")
    loss_agg: LossAgg = knob(
        "token-mean", "loss aggregation over the GLOBAL batch (token or sequence counts of all DP ranks)"
    )
    clip_ratio: float = knob(0.2, "ratio clip when trainer.mini_batches > 1")
    advantage_clip: float = knob(0.0, "clip advantages to [-c, c] (0: off)")
    moe_aux_loss: MoeAuxLoss = knob(
        "aux",
        "MoE load-balancing loss: aux = per micro-batch, token-weighted over the update; seq_aux = per sequence; none",
    )
    moe_aux_loss_coef: float = knob(1e-3, "MoE load-balancing loss coefficient (summed over layers; 0: off)")
    rollout_correction: RolloutCorrection = knob(
        "none",
        "importance-sampling correction of the engine/trainer "
        "mismatch: token-tis = each token's loss weighted by min(pi_actor / "
        "pi_engine, rollout_is_cap); seq-mis = a sequence whose geometric-"
        "mean ratio leaves [1/cap, cap] is masked out (still counted in the "
        "loss's denominator); none",
    )
    rollout_is_cap: float = knob(2.0, "the ratio cap of algo.rollout_correction (>= 1)")
    dynamic_sampling: bool = knob(
        False,
        "DAPO's dynamic sampling: a prompt whose samples all tie its greedy reward "
        "is dropped and more prompts are drawn and rolled out until the step holds "
        "trainer.prompts_per_step prompts with signal",
    )
    dynamic_sampling_max_rounds: int = knob(
        4,
        "algo.dynamic_sampling: at most this many rollout rounds a step; "
        "then the step is topped up with dropped prompts "
        "(sampling/short_prompts)",
    )

    def __post_init__(self):
        _positive("algo.kl_coef", self.kl_coef, zero_ok=True)
        _check_choices("algo", self)
        if self.kl_mode == "loss" and self.kl_estimator == "k1":
            raise ValueError(
                "algo.kl_mode=loss with algo.kl_estimator=k1 does not regularise (its gradient has zero "
                "expectation on-policy): set algo.kl_estimator=k3 (or k2)"
            )
        _positive("algo.kl_target", self.kl_target, zero_ok=True)
        _positive("algo.kl_horizon", self.kl_horizon)
        _positive("algo.clip_ratio", self.clip_ratio)
        _positive("algo.advantage_clip", self.advantage_clip, zero_ok=True)
        _positive("algo.moe_aux_loss_coef", self.moe_aux_loss_coef, zero_ok=True)
        _positive("algo.dynamic_sampling_max_rounds", self.dynamic_sampling_max_rounds)
        if not 1.0 <= self.rollout_is_cap < float("inf"):
            raise ValueError(
                f"algo.rollout_is_cap={self.rollout_is_cap!r} must be a finite number >= 1 (a ratio "
                "cap; 2.0 is the usual value)"
            )


@dataclass
class DataConfig:
    train: str = knob("builtin:arith", "JSONL / Parquet file, or builtin:<task>")
    eval: str = knob("", "held-out file; empty: split eval_size prompts off the train set")
    eval_size: int = knob(32, "prompts split off the train set for eval when data.eval is empty (0: no eval)")
    prompt_key: str = knob(
        "prompt",
        "column holding the prompt: a string, or a list of {role, content} messages "
        "(e.g. messages; TRL's conversational prompt) rendered by the chat template",
    )
    answer_key: str = knob("answer", "ground truth handed to reward functions")
    chat_template: bool = knob(
        True, "apply the tokenizer's chat template when it has one (message-list prompts need it)"
    )
    system_prompt: str = knob("", "a system turn put before every string prompt (needs a chat template)")
    max_prompt_tokens: int = knob(256, "longest prompt in tokens (after the chat template); see data.overlong")
    overlong: Overlong = knob("drop", "prompts over max_prompt_tokens: drop them, or truncate from the left")
    shuffle: bool = knob(True, "deterministic per-epoch shuffle from trainer.seed")

    def __post_init__(self):
        _positive("data.eval_size", self.eval_size, zero_ok=True)
        _positive("data.max_prompt_tokens", self.max_prompt_tokens)
        _check_choices("data", self)


@dataclass
class OptimConfig:
    lr: float = knob(1e-6, "peak learning rate (AdamW)")
    min_lr: float = knob(0.0, "learning rate at the end of a linear or cosine schedule")
    schedule: Schedule = knob("constant", "learning-rate decay after the warm-up")
    warmup_steps: int = knob(0, "linear warm-up, in optimizer updates")
    weight_decay: float = knob(0.0, "decoupled weight decay (AdamW)")
    beta1: float = knob(0.9, "Adam first-moment decay")
    beta2: float = knob(0.999, "Adam second-moment decay")
    eps: float = knob(1e-8, "Adam denominator epsilon")
    grad_clip: float = knob(1.0, "max global grad norm (0: off)")
    distributed_optimizer: bool = knob(True, "megatron's DistributedOptimizer on GPU")

    def __post_init__(self):
        _positive("optim.lr", self.lr)
        _positive("optim.min_lr", self.min_lr, zero_ok=True)
        _check_choices("optim", self)
        _positive("optim.warmup_steps", self.warmup_steps, zero_ok=True)
        _positive("optim.grad_clip", self.grad_clip, zero_ok=True)
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"optim.{key}={getattr(self, key)!r} must be in [0, 1)")


@dataclass
class CheckpointConfig:
    dir: str = knob("", "default <trainer.output_dir>/checkpoints")
    save_every: int = knob(0, "steps between saves (0: only at the end)")
    resume: str = knob("auto", "auto (newest valid) | none | a checkpoint path")
    keep: int = knob(2, "checkpoints kept (and HF exports)")
    hf_every: int = knob(
        0,
        "steps between Hugging Face exports of the actor (and at the last step) into "
        "<trainer.output_dir>/hf/step_N, through the converter's export; 0: none",
    )
    allow_model_change: bool = knob(
        False,
        "resume a checkpoint made from another actor.model (same shapes; refused "
        "otherwise): its weights train on with this model's config and tokenizer",
    )

    def __post_init__(self):
        _positive("checkpoint.save_every", self.save_every, zero_ok=True)
        _positive("checkpoint.hf_every", self.hf_every, zero_ok=True)
        _positive("checkpoint.keep", self.keep)
        if self.resume not in ("auto", "none") and not os.path.exists(self.resume):
            raise ValueError(
                f"checkpoint.resume={self.resume!r}: no such path; use auto, none or an existing checkpoint directory"
            )


@dataclass
class LoggingConfig:
    tensorboard: bool = knob(True, "TensorBoard events under <output_dir>/tensorboard")
    wandb_project: str = knob("", "non-empty: also log to Weights & Biases")
    progress_bar: bool = knob(True, "tqdm bar on rank 0")
    sample_completions: int = knob(3, "completions printed at each eval")
    rollouts_every: int = knob(
        0,
        "every N steps (and evals) write the step's rollouts to <output_dir>/rollouts/"
        "step_NNNNNN.jsonl (eval_step_...): prompt, response, tokens, finish reason, reward, "
        "baseline, advantage per response (0: never)",
    )
    level: LogLevel = knob(
        "warning",
        "libraries' log level on rank 0 (vLLM, transformers, torch's C++ log one level "
        "higher); other ranks show errors only; debug also shows the vLLM notices "
        "remax_megatron/console.py drops",
    )

    def __post_init__(self):
        _check_choices("logging", self)
        _positive("logging.rollouts_every", self.rollouts_every, zero_ok=True)


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        if not self.checkpoint.dir:
            self.checkpoint.dir = os.path.join(self.trainer.output_dir, "checkpoints")
        if self.actor.lora_rank and self.reference.model and self.reference.model != self.actor.model:
            raise ValueError(
                f"reference.model={self.reference.model!r} with actor.lora_rank={self.actor.lora_rank}: "
                "a LoRA actor's reference is its own base (adapters off); unset reference.model"
            )
        if self.algo.kl_coef > 0 and not self.reference.enabled and not self.actor.lora_rank:
            raise ValueError(
                f"algo.kl_coef={self.algo.kl_coef} needs a reference model: "
                "set reference.enabled=true (or algo.kl_coef=0)"
            )
        if not self.reward.functions and not self.reward.model and not self.rollout.env:
            raise ValueError("no reward: set reward.functions (e.g. [exact_match]) and/or reward.model")
        if (
            self.algo.rollout_correction != "none"
            and self.rollout.engine == "vllm"
            and (self.rollout.top_k or self.rollout.top_p < 1)
        ):
            raise ValueError(
                f"algo.rollout_correction={self.algo.rollout_correction} with rollout.top_k="
                f"{self.rollout.top_k} / rollout.top_p={self.rollout.top_p}: vLLM returns log-probs "
                "renormalised over the kept tokens, so the ratio would measure the truncation, not the "
                "mismatch; set rollout.top_k=0 and rollout.top_p=1, or use rollout.engine=native (it "
                "returns the untruncated log-probs)"
            )
        if self.algo.dynamic_sampling and self.rollout.placement == "separate" and self.rollout.max_staleness:
            raise ValueError(
                "algo.dynamic_sampling=true with rollout.placement=separate and rollout.max_staleness=1 "
                "is not supported (the next step's prompts are drawn before this step knows how many "
                "it needs): set rollout.max_staleness=0 or algo.dynamic_sampling=false"
            )
        first_turn = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if self.rollout.multi_turn and self.rollout.max_total_tokens < first_turn:
            raise ValueError(
                f"rollout.max_total_tokens={self.rollout.max_total_tokens} < data.max_prompt_tokens("
                f"{self.data.max_prompt_tokens}) + rollout.max_new_tokens({self.rollout.max_new_tokens}) = "
                f"{first_turn}: the longest prompt's first turn must fit; raise it or lower those"
            )
        if self.reward.turns == "last" and not self.rollout.multi_turn:
            raise ValueError(
                "reward.turns=last applies to multi-turn rollouts (rollout.env or rollout.tools) and none is "
                "set: remove it (a single-turn response is its last turn)"
            )
        if self.reward.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer={self.reward.overlong_buffer} is longer than rollout."
                f"max_new_tokens={self.rollout.max_new_tokens}: the buffer is the last tokens before "
                "that limit; use a buffer <= max_new_tokens (e.g. a quarter of it)"
            )
        budget = self.trainer.micro_batch_tokens
        if budget:
            multiple = sequence_multiple(self.actor.tp, self.actor.sequence_parallel)
            tokens, how = self.longest_sequence()
            longest = round_up(tokens, multiple)
            check_token_budget(
                budget,
                longest,
                f"the longest sequence this run can produce, {how}"
                f"{f' rounded up to a multiple of tp={multiple}' if multiple > 1 else ''} = {longest}",
            )

    def longest_sequence(self) -> tuple[int, str]:
        """The longest prompt + completion this run can produce, in tokens, and how an error spells it out
        (the one place the sum is written: config, start-up, the planner and the engine's length use it)."""
        d, r = self.data, self.rollout
        if r.multi_turn:  # a trajectory: prompt, turns and observations under one bound
            return r.max_total_tokens, f"rollout.max_total_tokens({r.max_total_tokens})"
        return (
            d.max_prompt_tokens + r.max_new_tokens,
            f"data.max_prompt_tokens({d.max_prompt_tokens}) + rollout.max_new_tokens({r.max_new_tokens})",
        )

    def start_warnings(self) -> list[str]:
        """Lines a run with this config prints at start (rank 0): settings that run but are likely a mistake."""
        out = []
        if (
            self.rollout.placement == "separate"
            and self.rollout.max_staleness
            and self.algo.rollout_correction == "none"
        ):
            out.append(
                "warning: rollout.max_staleness=1 trains on samples of the previous policy version without "
                "correction: set algo.rollout_correction=token-tis (or seq-mis)"
            )
        return out

    def train_world(self, world_size: int) -> int:
        """The ranks that train: the world, less the rollout ranks with rollout.placement=separate."""
        return world_size - self.rollout.ranks if self.rollout.placement == "separate" else world_size

    def rollout_world(self, world_size: int) -> int:
        """The ranks that run rollout engines: all of them, or rollout.ranks with rollout.placement=separate."""
        return self.rollout.ranks if self.rollout.placement == "separate" else world_size

    def check_world(self, world_size: int) -> None:
        """Layout checks that need the launched world size (one line, every factor named)."""
        # imported here: reading a config needs no torch (train.py refuses a bad key before importing it)
        from remax_megatron.parallel import ParallelLayout
        from remax_megatron.parallel.nested import check_nested
        from remax_megatron.parallel.split import check_split

        if self.rollout.placement == "separate":
            check_split(world_size, self.rollout.ranks, self.rollout.tp)
            world_size = self.train_world(world_size)
        try:
            ParallelLayout(
                tp=self.actor.tp, pp=self.actor.pp, world_size=world_size, ep=self.actor.ep, etp=self.actor.etp
            )
        except ValueError as e:
            raise ValueError(f"actor layout: {e}") from None
        dp = world_size // (self.actor.tp * self.actor.pp)
        t = self.trainer
        if t.prompts_per_step % dp:
            raise ValueError(f"trainer.prompts_per_step={t.prompts_per_step} is not divisible by dp={dp}")
        local = t.prompts_per_step // dp * self.rollout.n
        if t.micro_batch_tokens and local % t.mini_batches:
            raise ValueError(
                f"{local} sequences per DP rank (prompts_per_step/dp * rollout.n) are not divisible by "
                f"trainer.mini_batches({t.mini_batches})"
            )
        if not t.micro_batch_tokens and local % (t.mini_batches * t.micro_batch_size):
            raise ValueError(
                f"{local} sequences per DP rank (prompts_per_step/dp * rollout.n) are not divisible by "
                f"trainer.mini_batches({t.mini_batches}) * trainer.micro_batch_size({t.micro_batch_size})"
            )
        if self.reward.model:
            check_nested(self.reward.tp, self.reward.pp, self.actor.tp, self.actor.pp, dp)


# ---- loading ---------------------------------------------------------------------------------


def _convert(key: str, value, hint):
    """`value` as the type `hint`, or a ValueError naming the key."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if isinstance(value, bool) and "on" in allowed:  # YAML 1.1 reads a bare on / off as a boolean
            value = "on" if value else "off"
        value = _convert(key, value, type(allowed[0]))
        if value not in allowed:
            raise ValueError(f"{key}={value!r} is not one of {', '.join(allowed)}")
        return value
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, str):
            value = [v for v in (s.strip() for s in value.split(",")) if v] if value else []
        elif isinstance(value, (int, float)):
            value = [value]
        if not isinstance(value, list):
            raise ValueError(f"{key} expects a list, got {value!r}")
        return [_convert(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{key} expects true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"{key} expects an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{key} expects an integer, got {value!r}") from None
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(f"{key} expects a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} expects a number, got {value!r}") from None
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"{key} expects a string, got {value!r}")
        return "" if value is None else str(value)
    raise AssertionError(f"unhandled type {hint} for {key}")


def _sections() -> dict[str, type]:
    return {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _sections().items() for f in dataclasses.fields(cls)]


def _unknown(key: str) -> ValueError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}?" if close else ""
    return ValueError(f"unknown config key {key!r}{hint} (`python -m remax_megatron.train --help` lists every key)")


def _type_name(hint) -> str:
    if typing.get_origin(hint) is Literal:
        return " | ".join(typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    return hint.__name__


def config_help() -> str:
    """Every config key with its type, default and doc (the trainer's --help)."""
    lines = ["config keys (YAML `section: {key: value}` or a dotted override section.key=value):"]
    for section, cls in _sections().items():
        lines.append(f"  {section}:")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            lines.append(f"    {section}.{f.name} = {default!r}  [{_type_name(hints[f.name])}]  {f.metadata['doc']}")
    return "\n".join(lines)


def _set(tree: dict, key: str, raw) -> None:
    """Put one dotted key into the nested dict `tree` after checking it exists."""
    section, _, name = key.partition(".")
    sections = _sections()
    if section not in sections or not name:
        raise _unknown(key)
    hints = typing.get_type_hints(sections[section])
    if name not in hints:
        raise _unknown(key)
    tree.setdefault(section, {})[name] = _convert(key, raw, hints[name])


def _yaml_error(e: yaml.YAMLError, where: str, offset: int = 0) -> str:
    """One line for a YAML syntax error: `file:line:column: problem (context at line, column)`.

    An override (`offset` > 0: the length of `key=` before its value) gets a column only.
    """

    def at(mark) -> str:
        return f"column {mark.column + 1 + offset}" if offset else f"line {mark.line + 1}, column {mark.column + 1}"

    problem = getattr(e, "problem", None) or getattr(e, "reason", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if mark is None:  # a reader error (a forbidden character): a position only
        position = getattr(e, "position", None)
        return f"{where}: invalid YAML, {problem}" + (f" (character {position + 1})" if position is not None else "")
    head = f"{where}, {at(mark)}" if offset else f"{where}:{mark.line + 1}:{mark.column + 1}"
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    tail = f" ({context} at {at(context_mark)})" if context and context_mark is not None else ""
    return f"{head}: invalid YAML, {problem}{tail}"


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Config from a YAML file plus dotted overrides (`actor.tp=2`); raises ValueError on bad input."""
    tree: dict = {}
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file {path} not found")
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ValueError(_yaml_error(e, path)) from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a mapping of sections (trainer:, actor:, ...)")
        for section, values in data.items():
            if not isinstance(values, dict):
                raise (
                    _unknown(section)
                    if section not in _sections()
                    else ValueError(f"{path}: section {section!r} must be a mapping")
                )
            for name, value in values.items():
                _set(tree, f"{section}.{name}", value)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not key=value (e.g. actor.tp=2)")
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError as e:
            # Columns count from the start of the whole override, as the user typed it.
            raise ValueError(
                _yaml_error(e, f"override {item!r}", offset=len(key) + 1)
                + f"; to pass it as text, quote it for YAML too: \"{key.strip()}='{value}'\""
            ) from None
        _set(tree, key.strip(), value if isinstance(parsed, (dict,)) else parsed)
    sections = _sections()
    return Config(**{name: cls(**tree.get(name, {})) for name, cls in sections.items()})


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, output_dir: str) -> str:
    """Write the config actually used as <output_dir>/config.yaml (reloadable with load_config)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "config.yaml")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)
    return path
