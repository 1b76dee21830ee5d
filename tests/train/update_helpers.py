"""What the update tests build the same way: tiny HF models on disk and a Trainer that runs one update
(Updater.train_on) over a megatron DDP actor, without an engine."""

from tools.make_tiny_model import make_tiny_model


def tiny_llama(tmp_path_factory, tie: bool, seed: int) -> str:
    """The update tests' dense model: a 2-layer Llama, hidden 64, 4 heads over 2 KV heads."""
    return make_tiny_model(
        str(tmp_path_factory.mktemp("m") / "llama"),
        "llama",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=96,
        tie=tie,
        seed=seed,
    )


def tiny_moe(tmp_path_factory, folder: str, family: str, seed: int) -> str:
    """The update tests' MoE model: 2 layers, hidden 64, 4 experts with top-2 routing, a 128-token vocabulary."""
    return make_tiny_model(
        str(tmp_path_factory.mktemp(folder) / family),
        family,
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=32,
        vocab=128,
        experts=4,
        top_k=2,
        seed=seed,
    )


def update_config(*overrides):
    """The config with a rule-based reward (no reward model to build) and the given overrides."""
    from remax_megatron.config import load_config

    return load_config(None, ["reward.functions=[exact_match]", *overrides])


def update_trainer(groups, cfg, model_dir, tp, pp, parts=None, **build_kw):
    """(trainer, actor, ddp, optimizer): the actor built from model_dir's weights, wrapped in megatron DDP with
    the interface's optimizer on a 10-update schedule; KL off. `parts` adds or replaces Trainer parts."""
    from types import SimpleNamespace

    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.optimizer import attach_to_schedule, build_optimizer, build_scheduler, wrap_ddp
    from remax_megatron.trainer import Trainer
    from remax_megatron.weights import load_hf_weights

    actor = build_policy(read_hf_config(model_dir), tp=tp, pp=pp, init_weights=False, **build_kw)
    load_hf_weights(actor, model_dir)
    ddp = wrap_ddp(actor, False)
    opt = build_optimizer(ddp, cfg.optim)
    attach_to_schedule(ddp, opt)
    fields = dict(
        cfg=cfg,
        groups=groups,
        actor=ddp,
        optimizer=opt,
        scheduler=build_scheduler(opt, cfg.optim, 10),
        kl=SimpleNamespace(coef=0.0),
    )
    fields.update(parts or {})
    return Trainer(SimpleNamespace(**fields), logger=None), actor, ddp, opt


def moe_update_trainer(world, model_dir, tp, pp, ep, overrides, **expert_kw):
    """update_trainer over a MoE actor with update_config(*overrides): whole experts split over EP (expert TP
    only without EP), sequence parallel at TP > 1."""
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.parallel import ParallelLayout

    etp = 1 if ep > 1 else tp
    groups = ParallelLayout(tp=tp, pp=pp, world_size=world, ep=ep, etp=etp).initialize(seed=0)
    cfg = update_config(*overrides)
    experts = ExpertOptions(ep=ep, etp=etp, **expert_kw)
    return update_trainer(groups, cfg, model_dir, tp, pp, sequence_parallel=tp > 1, experts=experts)


def dp_share(trainer, batch):
    """This DP rank's contiguous share of the batch's rows, as RolloutDispatch.share gives it."""
    g = trainer.groups
    rows = batch["input_ids"].shape[0] // g.dp_size
    return {k: v[g.dp_rank * rows : (g.dp_rank + 1) * rows] for k, v in batch.items()}
