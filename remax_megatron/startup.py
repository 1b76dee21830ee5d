"""Start-up: check every input a user can get wrong, then build the trainer's components.

    checked = check_inputs(cfg, world_size)   # one-line ValueError / FileNotFoundError; nothing built or written
    prepare_models(cfg, checked)              # built-in models on first use, before any process group
    claim = claim_run(cfg, checked)           # collective: directory lock, the checkpoint to resume; ValueError
    parts = build(cfg, checked)               # process groups, models, optimizer, engine, reward

The checks import torch and transformers only: megatron-core, vLLM and the trainer are imported by
build(), so a mistake is refused before they load (seconds, not a minute).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from remax_megatron.rollout.agent import check_env_reward, env_factory_of
from remax_megatron.algo.zero_advantage import skips_zero_advantage
from remax_megatron.builtin.models import resolve_model
from remax_megatron.startup_times import StartupClock
from remax_megatron.data.prompts import Prompt, load_prompts
from remax_megatron.models.arch import (
    DTYPES,
    ExpertOptions,
    LoraOptions,
    ModelArch,
    check_lora_targets,
    check_packing,
    expert_options,
)
from remax_megatron.models.hf_config import check_layout, check_run_length, read_hf_config
from remax_megatron.reward.functions import PLACEHOLDER, RewardBatch, RewardFunctions
from remax_megatron.reward.rm_inputs import RewardModelInputs, load_rm_tokenizer
from remax_megatron.rollout.factory import check_rollout
from remax_megatron.weights.hf_io import HFCheckpointReader

if TYPE_CHECKING:  # annotations only: torch and the run lock are imported where they are used
    import torch

    from remax_megatron.run_lock import RunLock


def check_writable(path: str, what: str) -> None:
    """Refuse a directory this process cannot create or write into, before any work.

    Probed, not guessed from permission bits (root passes os.access on /sys, read-only mounts and
    the like): a temporary file in `path` when it exists, else a temporary directory in its
    nearest existing ancestor; both are removed at once, so a refused run leaves nothing behind."""
    target = os.path.abspath(path)
    probe = target
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        if not os.path.isdir(probe):
            raise NotADirectoryError(f"{probe} is a file, not a directory")
        if probe == target:
            with tempfile.TemporaryFile(dir=probe):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".remax-probe-", dir=probe))
    except OSError as e:
        reason = e.args[0] if isinstance(e, NotADirectoryError) else f"{type(e).__name__}: {e.strerror or e}"
        raise ValueError(
            f"{what}={path} cannot be {'written' if probe == target else 'created'} ({reason}): "
            "point it at a writable directory"
        ) from None


@dataclass
class CheckedInputs:
    """What check_inputs resolved. Nothing is built yet: a built-in model's directory holds its config
    and tokenizer only until build() trains it (the first time; cached afterwards)."""

    arch: ModelArch  # the actor's (and the reference's) architecture
    actor_dir: str
    ref_dir: str | None
    rm_dir: str | None
    rm_arch: ModelArch | None
    rm_inputs: RewardModelInputs | None  # the prompt/response re-tokenisation for the reward model
    functions: RewardFunctions | None
    tokenizer: PreTrainedTokenizerBase
    train: list[Prompt]
    eval: list[Prompt]
    data_counts: dict  # what the data loader kept and dropped, for the first log line
    experts: ExpertOptions  # how a MoE actor's experts run (dense: the defaults)


def check_inputs(cfg, world_size: int) -> CheckedInputs:
    """All user-input checks, before any process group, model or file is created (built-in models are
    not built either: a mistake is refused in a second, not after a minute of building)."""
    cfg.check_world(world_size)
    check_writable(cfg.trainer.output_dir, "trainer.output_dir")
    check_writable(cfg.checkpoint.dir, "checkpoint.dir")
    actor_dir = resolve_model(cfg.actor.model, "actor.model", build=False)
    arch = read_hf_config(actor_dir)
    check_layout(arch, cfg.actor.tp, cfg.actor.pp, "actor", ep=cfg.actor.ep)
    check_lora(cfg, arch)
    skips_zero_advantage(cfg, arch.is_moe)  # trainer.skip_zero_advantage=on where it would change the update
    experts = expert_options(cfg, arch)
    if cfg.trainer.pack_sequences:
        check_packing(DTYPES[cfg.actor.dtype], local_spec=bool(cfg.actor.lora_rank))
    check_rollout(cfg.rollout, arch, cfg.rollout_world(world_size))
    env_factory = env_factory_of(cfg) if cfg.rollout.multi_turn else None  # imports, has step(), tools: now
    if env_factory is not None:
        check_env_reward(cfg, env_factory)
    beyond = [t for t in cfg.rollout.stop_token_ids if t >= arch.vocab_size]
    if beyond:
        raise ValueError(
            f"rollout.stop_token_ids: {beyond[:5]} are not tokens of actor.model {actor_dir} "
            f"(vocab_size {arch.vocab_size}): use ids below it"
        )
    longest, how = cfg.longest_sequence()
    check_run_length(arch, longest, f"actor.model {actor_dir}", how)
    if arch.task != "causal_lm":
        raise ValueError(f"actor.model {actor_dir} is a {arch.architecture}: the actor must be a *ForCausalLM")
    # A LoRA actor is its own reference (adapters off): no reference model is read or built.
    ref_dir = (
        resolve_model(cfg.reference.model or cfg.actor.model, "reference.model", build=False)
        if cfg.reference.enabled and not cfg.actor.lora_rank
        else None
    )
    if ref_dir and read_hf_config(ref_dir) != arch:
        raise ValueError(f"reference.model {ref_dir} has a different architecture than actor.model {actor_dir}")
    rm_dir, rm_arch = check_reward_model(cfg)
    functions = (
        RewardFunctions(
            cfg.reward.functions,
            cfg.reward.weights,
            {
                "pattern": cfg.reward.format_pattern,
                "tolerance": cfg.reward.numeric_tolerance,
                "limit": cfg.reward.length_limit,
            },
        )
        if cfg.reward.functions
        else None
    )
    check_weight_files(cfg, actor_dir, ref_dir, rm_dir)
    tokenizer = AutoTokenizer.from_pretrained(actor_dir)
    if len(tokenizer) > arch.vocab_size:
        raise ValueError(
            f"the tokenizer of actor.model {actor_dir} has {len(tokenizer)} tokens but the model's "
            f"vocabulary {arch.vocab_size} (config.json vocab_size): ids from {arch.vocab_size} on have "
            "no embedding; use the model's own tokenizer, or resize the model's embeddings to the "
            "tokenizer (transformers: model.resize_token_embeddings(len(tokenizer))) and save it"
        )
    schemas = [t.schema for t in env_factory.keywords["tools"]] if cfg.rollout.tools else None
    train, evals, counts = load_prompts(cfg.data, tokenizer, cfg.reward.functions, tools=schemas)
    if functions is not None:
        probe_reward_functions(functions, train, cfg.data.train, tokenizer, env_factory)
    rm_inputs = None
    if rm_dir:
        rm_inputs = RewardModelInputs(tokenizer, load_rm_tokenizer(rm_dir), chat_template=cfg.data.chat_template)
        rm_inputs.check_prompts([q.text for q in train + evals], [q.messages for q in train + evals])
    return CheckedInputs(
        arch=arch,
        actor_dir=actor_dir,
        ref_dir=ref_dir,
        rm_dir=rm_dir,
        rm_arch=rm_arch,
        rm_inputs=rm_inputs,
        functions=functions,
        tokenizer=tokenizer,
        train=train,
        eval=evals,
        data_counts=counts,
        experts=experts,
    )


def check_reward_model(cfg) -> tuple[str | None, ModelArch | None]:
    """reward.model's directory and architecture (None, None without one): a *ForSequenceClassification
    that reward.tp x reward.pp can split and that holds the run's longest sequence."""
    if not cfg.reward.model:
        return None, None
    rm_dir = resolve_model(cfg.reward.model, "reward.model", build=False)
    rm_arch = read_hf_config(rm_dir)
    if rm_arch.task != "reward":
        raise ValueError(f"reward.model {rm_dir} is a {rm_arch.architecture}: use a *ForSequenceClassification")
    check_layout(rm_arch, cfg.reward.tp, cfg.reward.pp, "reward")
    longest, how = cfg.longest_sequence()
    check_run_length(rm_arch, longest, f"reward.model {rm_dir}", how)
    return rm_dir, rm_arch


def check_weight_files(cfg, actor_dir: str, ref_dir: str | None, rm_dir: str | None) -> None:
    """Every weight file of the models the run reads is there, readable and complete (headers only); a
    built-in model gets its weights at build()."""
    for spec, path, what in (
        (cfg.actor.model, actor_dir, "actor.model"),
        (cfg.reference.model or cfg.actor.model, ref_dir, "reference.model"),
        (cfg.reward.model, rm_dir, "reward.model"),
    ):
        if path and not spec.startswith("builtin:"):
            try:
                HFCheckpointReader(path)
            except (FileNotFoundError, ValueError) as e:
                raise type(e)(f"{what}: {e}") from None


def probe_reward_functions(
    functions: RewardFunctions, prompts: list[Prompt], source: str, tokenizer, env_factory=None, rows: int = 2
) -> None:
    """Every reward function called once on the first `rows` prompts, each with a placeholder completion (and,
    with rollout.env, a fresh environment of the row as `env`): a wrong signature, count or type is one line
    now, not at the first evaluation a minute in."""
    first = prompts[:rows]
    ids = tokenizer(PLACEHOLDER, add_special_tokens=False)["input_ids"]
    envs = {"env": [env_factory(**q.columns) for q in first]} if env_factory is not None else {}
    functions.probe(
        RewardBatch(
            prompts=[q.text for q in first],
            responses=[PLACEHOLDER] * len(first),
            columns={
                **{k: [q.columns.get(k) for q in first] for k in sorted({k for q in first for k in q.columns})},
                **envs,
            },
            prompt_index=[q.index for q in first],
            raw_prompts=[q.raw for q in first],
            completion_ids=[list(ids) for _ in first],
            chat=any(q.is_chat for q in first),
        ),
        f"the first {len(first)} rows of {source}",
    )


@dataclass
class Claim:
    """What claim_run settled: the run's directory lock (rank 0; None on the other ranks) and the
    checkpoint every rank resumes (None: a fresh start)."""

    lock: RunLock | None
    resume: str | None


def claim_run(cfg, checked: CheckedInputs) -> Claim:
    """Collective, after check_inputs and before build: the process group; the run's directories,
    locked by rank 0 (run_lock.py says why rank 0), which then removes the saves an earlier run left
    unfinished; the checkpoint to resume, the same on every rank; whether this config fits it
    (resume.check_resume). A refusal is the same ValueError on every rank, and leaves nothing written."""
    import torch

    from remax_megatron.checkpoint import find_resume_checkpoint, remove_stale_saves
    from remax_megatron.parallel import init_distributed
    from remax_megatron.resume import check_resume, read_trainer_state
    from remax_megatron.run_lock import DirectoryInUse, RunLock

    rank, world = init_distributed(cfg.trainer.dist_timeout_minutes)
    lock, refusal = None, [None]
    if rank == 0:
        try:
            lock = RunLock.acquire({"trainer.output_dir": cfg.trainer.output_dir, "checkpoint.dir": cfg.checkpoint.dir})
        except DirectoryInUse as e:
            refusal[0] = str(e)
    if world > 1:
        torch.distributed.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        raise ValueError(refusal[0])
    try:
        path = find_resume_checkpoint(cfg.checkpoint.dir, cfg.checkpoint.resume)
        if path is not None:
            check_resume(cfg, path, read_trainer_state(path), checked.actor_dir, checked.tokenizer, checked.train)
        if rank == 0:  # the run goes ahead: nothing else can be writing there now
            for stale in remove_stale_saves(cfg.checkpoint.dir):
                print(f"removed {stale}: the unfinished save of an earlier run", flush=True)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Claim(lock=lock, resume=path)


def check_lora(cfg, arch: ModelArch) -> None:
    """LoRA checks that need the model or the machine (one line each): MoE experts cannot take adapters;
    a LoRA actor runs megatron's local layer spec, so Transformer Engine's grouped experts are not there for
    it (packed rows are: models/attention.py takes THD)."""
    if not cfg.actor.lora_rank:
        return
    experts = [t for t in cfg.actor.lora_targets if t in ("linear_fc1", "linear_fc2")]
    mla = getattr(arch, "is_mla", False)  # callers may pass any object with the MoE facts
    if arch.is_moe and experts:
        attention = "linear_q_down_proj,linear_q_up_proj,linear_kv_down_proj,linear_kv_up_proj" if mla else "linear_qkv"
        raise ValueError(
            f"actor.lora_targets holds {experts}, which are MoE experts in {arch.architecture}: LoRA on "
            f"experts is not supported; use actor.lora_targets=[{attention},linear_proj]"
        )
    check_lora_targets(cfg.actor.lora_targets, mla, getattr(arch, "architecture", "the model"))
    if arch.is_moe and cfg.actor.moe_experts == "grouped":
        raise ValueError(
            f"actor.moe_experts=grouped with actor.lora_rank={cfg.actor.lora_rank}: the LoRA actor runs "
            "megatron's local layer spec, without Transformer Engine's grouped experts; use "
            "actor.moe_experts=sequential or auto"
        )


def lora_options(cfg) -> LoraOptions | None:
    """The actor's adapters (None: actor.lora_rank=0, full fine-tuning)."""
    a = cfg.actor
    if not a.lora_rank:
        return None
    return LoraOptions(
        rank=a.lora_rank,
        alpha=a.lora_alpha,
        targets=tuple(a.lora_targets),
        dropout=a.lora_dropout,
        seed=cfg.trainer.seed,
    )


def prepare_models(cfg, checked: CheckedInputs) -> None:
    """Build the built-in models the run names (on first use; a no-op for model directories and once
    cached). Before the process group exists: transformers saves a model only on rank 0 of an
    initialised group, and any rank may win the build's lock."""
    resolve_model(cfg.actor.model, "actor.model")
    if checked.ref_dir:
        resolve_model(cfg.reference.model or cfg.actor.model, "reference.model")
    if checked.rm_dir:
        resolve_model(cfg.reward.model, "reward.model")


def build(cfg, checked: CheckedInputs, bridge=None, clock: StartupClock | None = None):
    """Process groups, models, optimizer, engine, reward: the trainer's Components (built-in models
    built first by prepare_models). rollout.placement=separate: the engine is the rollout ranks' (`bridge`:
    parallel/split.py's, on training rank 0). clock: times each part (time/startup/<part>_s)."""
    import torch

    from remax_megatron.algo.kl_controller import KLController
    from remax_megatron.data.prompts import PromptSampler
    from remax_megatron.models.gpt import params_dtype_of
    from remax_megatron.optimizer import attach_to_schedule, build_optimizer, build_scheduler, wrap_ddp
    from remax_megatron.parallel import ParallelLayout, init_distributed
    from remax_megatron.reward.scoring import RewardScorer
    from remax_megatron.reward.workers import RewardWorkers
    from remax_megatron.trainer import Components

    # Built already (prepare_models): the built models' directories, or the model directories as given.
    actor_dir = resolve_model(cfg.actor.model, "actor.model")
    ref_dir = checked.ref_dir and resolve_model(cfg.reference.model or cfg.actor.model, "reference.model")
    rm_dir = checked.rm_dir and resolve_model(cfg.reward.model, "reward.model")
    clock = clock or StartupClock()
    with clock.part("process_groups"):
        _, world = init_distributed(cfg.trainer.dist_timeout_minutes)
        groups = ParallelLayout(
            tp=cfg.actor.tp, pp=cfg.actor.pp, world_size=world, ep=cfg.actor.ep, etp=cfg.actor.etp
        ).initialize(seed=cfg.trainer.seed, timeout_minutes=cfg.trainer.dist_timeout_minutes)
    torch.manual_seed(cfg.trainer.seed)
    dtype = params_dtype_of(cfg.actor.dtype)
    actor, reference, reward_model = build_models(cfg, checked, dtype, actor_dir, ref_dir, rm_dir, clock)
    with clock.part("optimizer"):
        ddp = wrap_ddp(actor, cfg.optim.distributed_optimizer)
        optimizer = build_optimizer(ddp, cfg.optim, dtype, groups)
        attach_to_schedule(ddp, optimizer)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.trainer.steps * cfg.trainer.mini_batches)
    with clock.part("engine"):
        if cfg.rollout.placement == "separate":
            from remax_megatron.rollout.remote import RemoteEngine

            engine = RemoteEngine(bridge, dtype=dtype, seed=cfg.trainer.seed)
        else:
            engine = build_rollout_engine(cfg, checked, actor_dir)
    tok = checked.tokenizer
    # Worker processes start on the first scoring call: a failure there stops every rank in one line.
    workers = (
        RewardWorkers(checked.functions, cfg.reward.workers, cfg.reward.timeout_s, cfg.reward.timeout_value)
        if cfg.reward.workers
        else None
    )
    scorer = RewardScorer(
        checked.functions,
        reward_model,
        cfg.reward.model_weight,
        micro_batch_size=cfg.trainer.micro_batch_size,
        rm_inputs=checked.rm_inputs,
        micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        workers=workers,
        mp_group=groups.mp,
    )
    return Components(
        cfg=cfg,
        groups=groups,
        actor=ddp,
        reference=reference,
        optimizer=optimizer,
        scheduler=scheduler,
        engine=engine,
        scorer=scorer,
        tokenizer=tok,
        sampler=PromptSampler(checked.train, cfg.trainer.seed, cfg.data.shuffle),
        eval_prompts=checked.eval,
        kl=KLController(cfg.algo.kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon),
        hf_dir=actor_dir,
        startup=clock,
    )


def build_models(
    cfg,
    checked: CheckedInputs,
    dtype: torch.dtype,
    actor_dir: str,
    ref_dir: str | None,
    rm_dir: str | None,
    clock: StartupClock | None = None,
):
    """The actor (with its LoRA adapters), the reference and the reward model (None when not used), their
    weights loaded from their directories; after ParallelLayout.initialize. clock: times the builds
    (time/startup/model_build_s) apart from the loads (time/startup/hf_load_s)."""
    import torch

    from remax_megatron.models import build_policy, build_reward_model
    from remax_megatron.weights import load_hf_weights

    recompute = None if cfg.actor.recompute == "none" else cfg.actor.recompute
    common = dict(
        tp=cfg.actor.tp,
        pp=cfg.actor.pp,
        params_dtype=dtype,
        sequence_parallel=cfg.actor.sequence_parallel,
        make_vocab_size_divisible_by=cfg.actor.make_vocab_size_divisible_by,
        init_weights=False,
    )
    lora = lora_options(cfg)
    clock = clock or StartupClock()
    with clock.part("model_build"):
        actor = build_policy(
            checked.arch, recompute_granularity=recompute, experts=checked.experts, lora=lora, **common
        )
    with clock.part("hf_load"):
        load_hf_weights(actor, actor_dir)
    if lora is not None and torch.distributed.get_rank() == 0:
        print(
            f"LoRA actor: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}; base frozen"
            + (
                "; no reference model is built, the KL reference is the actor with its adapters off"
                if cfg.algo.kl_coef > 0
                else ""
            ),
            flush=True,
        )
    reference = None
    if ref_dir:  # the reference routes on its own (no replay)
        with clock.part("model_build"):
            reference = build_policy(
                checked.arch,
                trainable=False,
                **common,
                experts=dataclasses.replace(checked.experts, routing_replay=False),
            )
        with clock.part("hf_load"):
            load_hf_weights(reference, ref_dir)
    reward_model = None
    if rm_dir:
        with clock.part("model_build"):
            reward_model = build_reward_model(
                checked.rm_arch,
                tp=cfg.reward.tp,
                pp=cfg.reward.pp,
                params_dtype=dtype,
                sequence_parallel=cfg.actor.sequence_parallel,
                init_weights=False,
                make_vocab_size_divisible_by=cfg.actor.make_vocab_size_divisible_by,
            )
        with clock.part("hf_load"):
            load_hf_weights(reward_model, rm_dir)
    return actor, reference, reward_model


def build_rollout_engine(cfg, checked: CheckedInputs, actor_dir: str | None = None):
    """The run's rollout engine on this rank (colocated: every rank; separate: the rollout ranks), its weights
    still to be synced."""
    from remax_megatron.models.gpt import params_dtype_of
    from remax_megatron.rollout.factory import build_engine

    return build_engine(
        cfg.rollout,
        hf_dir=actor_dir or resolve_model(cfg.actor.model, "actor.model"),
        arch=checked.arch,
        seed=cfg.trainer.seed,
        dtype=params_dtype_of(cfg.actor.dtype),
        max_model_len=cfg.longest_sequence()[0],
    )
