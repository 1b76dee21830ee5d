"""LoRA on the actor (models/lora.py), on CPU with gloo.

- config: one-line errors for bad LoRA keys; MoE experts refused; what Transformer Engine would run
- at init (B = 0) the LoRA actor's logits equal the base model's bitwise (world 1 and TP2; a MoE actor)
- the merge W + (alpha/r) B A, computed in fp32 per TP shard, equals an fp64 reference; a bf16 export
  rounds it once
- two updates (the second moves A too) at TP2, TP2 + sequence parallel, PP2, PP2 + full recompute, DP2,
  TP2 x PP2 and TP2 x DP2 equal world 1 (loss, grad norm, merged weights within 1e-5); only adapter
  tensors change, base weights stay bitwise; A stays equal on the TP ranks that replicate it
- the reference from the disabled adapters equals a separately built reference model (1e-6), TP2 and PP2
- the native and vLLM CPU engines after a sync from a TP2 LoRA actor give the actor's log-probs (1e-5, fp32)
- a checkpoint of adapters + optimizer at TP2 resumes exactly at TP2 and to 1e-5 at TP1 x DP2 and PP2; the
  converter writes its merged weights at TP2 and TP1
"""

import json
import os

import pytest
import torch

from tests._dist import SharedLaunches
from tests.train.test_update import _batch  # the update tests' batch: 8 rows, responses of 1..7 tokens
from tests.train.update_helpers import dp_share, tiny_llama, update_config, update_trainer
from tools.bench_noise_floor import random_adapters
from tools.make_tiny_model import make_tiny_model

RANK, ALPHA = 4, 16.0  # scale 4: a dropped alpha/r shows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # tied embeddings: at PP2 the frozen embedding's (absent) grad goes through megatron's embedding all-reduce
    return tiny_llama(tmp_path_factory, tie=True, seed=7)


def _trainer(world, model_dir, tp, pp, overrides=(), lora=True):
    """A Trainer over a (LoRA) megatron DDP actor and the interface's optimizer (no engine)."""
    from types import SimpleNamespace

    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.startup import lora_options

    groups = ParallelLayout(tp=tp, pp=pp, world_size=world).initialize(seed=0)
    cfg = update_config(
        "optim.lr=1e-2",
        "optim.grad_clip=0",
        "optim.eps=1e-3",
        "trainer.micro_batch_size=2",
        *([f"actor.lora_rank={RANK}", f"actor.lora_alpha={ALPHA}"] if lora else []),
        *overrides,
    )
    trainer, actor, _, opt = update_trainer(
        groups,
        cfg,
        model_dir,
        tp,
        pp,
        parts=dict(reference=None, kl=SimpleNamespace(coef=cfg.algo.kl_coef)),
        lora=lora_options(cfg),
        sequence_parallel=cfg.actor.sequence_parallel,
        recompute_granularity=None if cfg.actor.recompute == "none" else cfg.actor.recompute,
    )
    return trainer, actor, opt


# ---- bodies (run in every process) ----------------------------------------------------------------


def _init_body(rank, world, model_dir, out_path):
    """LoRA at init vs the base model: logits bitwise equal; and the fp32 merge vs fp64."""
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.lora import LoraOptions, lora_modules
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=world, pp=1, world_size=world).initialize(seed=0)
    arch = read_hf_config(model_dir)
    lora = build_policy(arch, tp=world, pp=1, init_weights=False, lora=LoraOptions(rank=RANK, alpha=ALPHA))
    base = build_policy(arch, tp=world, pp=1, init_weights=False)
    for m in (lora, base):
        load_hf_weights(m, model_dir)
    ids = torch.randint(4, 100, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = lora.full_logits(lora.run(ids)), base.full_logits(base.run(ids))
    assert torch.equal(got, want), (got - want).abs().max()
    trainable = sorted(n for n, p in lora.named_parameters() if p.requires_grad)
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable), trainable
    assert len(trainable) == 2 * 4 * arch.num_layers  # q/k/v + o + fc1 + fc2 in every layer
    # merge: random B, fp32 per-shard merge vs fp64
    worst = 0.0
    g = torch.Generator().manual_seed(3 + rank)
    for m in lora_modules(lora).values():
        with torch.no_grad():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g))
        merged = m.merged_weight()
        ref = m.weight.double() + ALPHA / RANK * (m.lora_B.double() @ m.lora_A.double())
        assert merged.dtype == torch.float32 and merged.shape == m.weight.shape
        worst = max(worst, (merged.double() - ref).abs().max().item())
    assert worst < 1e-5, worst
    if rank == 0:
        torch.save({"merge_err": worst}, out_path)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _update_body(rank, world, model_dir, tp, pp, out_path, sp=False, recompute="none"):
    """Two updates (the first moves only B: A's gradient is 0 while B = 0; the second moves A too)."""
    from remax_megatron.models.lora import is_adapter
    from remax_megatron.weights import export_hf_weights

    trainer, actor, opt = _trainer(
        world, model_dir, tp, pp, [f"actor.sequence_parallel={sp}", f"actor.recompute={recompute}"]
    )
    assert actor.config.sequence_parallel == sp
    assert actor.config.recompute_granularity == (None if recompute == "none" else recompute)
    before = _snapshot(actor)
    assert all(not p.requires_grad for n, p in actor.named_parameters() if not is_adapter(n))
    stats = []
    batch = _batch()
    for _ in range(2):
        local = dp_share(trainer, batch)
        stats.append(trainer.updater.train_on(local, None, None).stats)
        batch["rewards"] = batch["rewards"].flip(0)  # another advantage for the second update
    after = _snapshot(actor)
    for n in before:
        if is_adapter(n):
            assert not torch.equal(before[n], after[n]), f"{n} did not move"
        else:
            assert torch.equal(before[n], after[n]), f"base weight {n} changed"
    # A of a column-parallel linear is replicated over TP: it must stay equal on every TP rank.
    g = trainer.groups
    for n, p in actor.named_parameters():
        if is_adapter(n) and not getattr(p, "tensor_model_parallel", False) and g.tp_size > 1:
            others = [torch.empty_like(p) for _ in range(g.tp_size)]
            torch.distributed.all_gather(others, p.detach().contiguous(), group=g.tp)
            assert all(torch.equal(o, others[0]) for o in others), f"{n} differs between TP ranks"
    state = sum(t.numel() for t in opt.state_tensors())
    adapters = [p for n, p in actor.named_parameters() if is_adapter(n)]
    # Adam's two moments and step count of each adapter, nothing of the base weights
    assert state == 2 * sum(p.numel() for p in adapters) + len(adapters), state
    weights = {n: t.clone() for n, t in export_hf_weights(actor)}
    if rank == 0:
        torch.save({"stats": stats, "weights": weights}, out_path)


def _reference_body(rank, world, model_dir, tp, pp, out_path):
    """After updates (adapters non-zero), the actor with adapters off == a built reference model."""
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.weights import load_hf_weights

    trainer, actor, _ = _trainer(world, model_dir, tp, pp, ["algo.kl_coef=0.1"])
    batch = _batch()
    for _ in range(2):
        trainer.updater.train_on(batch, None, None)
        batch["rewards"] = batch["rewards"].flip(0)
    reference = build_policy(read_hf_config(model_dir), tp=tp, pp=pp, init_weights=False, trainable=False)
    load_hf_weights(reference, model_dir)
    plan = trainer.updater.micro_batch_plan(batch)[1]
    from_adapters_off = trainer.updater.reference_logprobs(batch, plan)
    from_model = trainer.updater.logprobs(reference, batch, plan)
    actor_lp = trainer.updater.logprobs(actor, batch, plan)
    mask = batch["labels"] != -100
    gap = moved = None
    if trainer.groups.is_last_stage:
        gap = (from_adapters_off - from_model)[mask].abs().max().item()
        moved = (actor_lp - from_model)[mask].abs().max().item()
    assert all(m.lora_enabled for m in actor.modules() if hasattr(m, "lora_enabled"))  # switched back on
    if trainer.groups.is_last_stage and trainer.groups.tp_rank == 0:  # log-probs live on the last stage
        torch.save({"gap": gap, "moved": moved}, out_path)


def _engine_body(rank, world, model_dir, out_path):
    """TP2 LoRA actor -> native engine through the trainer's WeightSync: log-probs vs the actor's."""
    from remax_megatron.rollout import WeightSync
    from remax_megatron.rollout.native import NativeEngine

    trainer, actor, _ = _trainer(world, model_dir, world, 1)
    random_adapters(actor, trainer.groups.tp_rank)
    engine = NativeEngine(hf_dir=model_dir, seed=0, dtype=torch.float32, device="cpu")
    WeightSync(engine, actor, bucket_mb=0.05, groups=trainer.groups)()
    batch = _batch()
    actor_lp = trainer.updater.logprobs(actor, batch, trainer.updater.micro_batch_plan(batch)[1])
    engine_lp = engine.score(batch["input_ids"], batch["labels"])
    mask = batch["labels"] != -100
    from remax_megatron.models.lora import adapters_disabled

    with adapters_disabled(actor):
        base_lp = trainer.updater.logprobs(actor, batch, trainer.updater.micro_batch_plan(batch)[1])
    if rank == 0:
        torch.save(
            {
                "gap": (actor_lp - engine_lp)[mask].abs().max().item(),
                "adapter_effect": (actor_lp - base_lp)[mask].abs().max().item(),
            },
            out_path,
        )


def _resume_body(rank, world, model_dir, top, out_path):
    """TP2: update, save, update; a fresh actor loads the save and makes the same second update."""
    from remax_megatron.checkpoint import load_checkpoint, save_checkpoint

    batch = _batch()
    trainer, actor, opt = _trainer(world, model_dir, world, 1)
    trainer.updater.train_on(batch, None, None)
    path = save_checkpoint(os.path.join(top, "ckpt"), 1, actor, opt, {"step": 1}, model_dir, keep=2)
    second = batch | {"rewards": batch["rewards"].flip(0)}
    want = trainer.updater.train_on(second, None, None).stats
    want_params = _snapshot(actor)
    trainer, actor, opt = _trainer(world, model_dir, world, 1, ["trainer.seed=5"])  # other adapter init
    load_checkpoint(path, actor, opt)
    got = trainer.updater.train_on(second, None, None).stats
    got_params = _snapshot(actor)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"], (got, want)
    for n in want_params:
        assert torch.equal(got_params[n], want_params[n]), n
    if rank == 0:
        torch.save({"ok": True, "path": path, "want": want}, out_path)
    torch.distributed.barrier()  # resume-tp1 reads it next


def _resume_other_layout_body(rank, world, model_dir, saved_path, out_path, tp, pp):
    """The TP2 save of _resume_body loaded at TP1 x DP2 or PP2: the same second update (adapters, Adam
    state and fc1's gate / up split resharded; at PP2 each stage loads its own layers' adapters)."""
    saved = torch.load(saved_path)
    from remax_megatron.checkpoint import load_checkpoint

    batch = _batch()
    second = batch | {"rewards": batch["rewards"].flip(0)}
    trainer, actor, opt = _trainer(world, model_dir, tp, pp, ["trainer.seed=5"])
    load_checkpoint(saved["path"], actor, opt)
    got = trainer.updater.train_on(dp_share(trainer, second), None, None).stats
    if rank == 0:
        torch.save({"got": got, "want": saved["want"]}, out_path)


def _convert_body(rank, world, model_dir, top, out_path):
    """TP2 LoRA actor saved as a model checkpoint; tools/convert_megatron_to_hf at TP2 and TP1 writes the
    merged weights the actor exports."""
    import torch.distributed as dist

    from remax_megatron.weights import HFCheckpointReader, export_hf_weights
    from remax_megatron.weights.megatron_ckpt import save_model
    from tools import convert_megatron_to_hf

    trainer, actor, _ = _trainer(world, model_dir, world, 1)
    random_adapters(actor, trainer.groups.tp_rank)
    merged = {n: t.clone() for n, t in export_hf_weights(actor)}
    ckpt = os.path.join(top, "lora-ckpt")
    if rank == 0:
        os.makedirs(ckpt)
    dist.barrier()
    save_model(actor, ckpt, model_dir)
    worst = {}
    for tp in (2, 1):
        out = os.path.join(top, f"lora-hf-tp{tp}")
        convert_megatron_to_hf.convert(ckpt, out, tp=tp)
        if rank == 0:
            got = dict(HFCheckpointReader(out).tensors())
            assert sorted(got) == sorted(merged)
            worst[tp] = max((got[n] - merged[n]).abs().max().item() for n in merged)
    if rank == 0:
        base = dict(HFCheckpointReader(model_dir).tensors())
        moved = max((merged[n] - base[n]).abs().max().item() for n in merged)
        torch.save({"worst": worst, "moved": moved}, out_path)
    dist.barrier()


def _peft_body(rank, world, model_dir, top, out_path):
    """TP2 x PP2 LoRA actor (random adapters) saved as a model checkpoint; tools/convert_megatron_to_hf --peft
    at the same layout writes the PEFT adapter directory; the merged export is what the actor syncs."""
    import torch.distributed as dist

    from remax_megatron.weights import export_hf_weights
    from remax_megatron.weights.megatron_ckpt import save_model
    from tools import convert_megatron_to_hf

    trainer, actor, _ = _trainer(world, model_dir, 2, 2)
    random_adapters(actor, trainer.groups.tp_rank)
    merged = {n: t.clone() for n, t in export_hf_weights(actor)}
    ckpt = os.path.join(top, "peft-ckpt")
    if rank == 0:
        os.makedirs(ckpt)
    dist.barrier()
    save_model(actor, ckpt, model_dir)
    convert_megatron_to_hf.convert(ckpt, os.path.join(top, "peft-adapter"), tp=2, pp=2, peft=True)
    if rank == 0:
        torch.save({"merged": merged, "adapter": os.path.join(top, "peft-adapter")}, out_path)
    dist.barrier()


def _bf16_body(rank, world, model_dir, out_path):
    """bf16 actor: the export casts the fp32 merge once (W + (alpha/r) B A rounded to bf16 one time), as an fp64
    reference rounded to bf16 is; merging in bf16 would round W's update away."""
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.lora import LoraOptions, lora_modules
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import export_hf_weights, load_hf_weights

    ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    actor = build_policy(
        read_hf_config(model_dir),
        tp=1,
        pp=1,
        init_weights=False,
        params_dtype=torch.bfloat16,
        lora=LoraOptions(rank=RANK, alpha=ALPHA),
    )
    load_hf_weights(actor, model_dir)
    random_adapters(actor, 0)
    with torch.no_grad():
        for p in actor.parameters():
            if p.requires_grad:
                p.mul_(0.02)  # a small update, as after a few steps: bf16 rounding of W would eat it
    exported = dict(export_hf_weights(actor, dtype=torch.bfloat16))
    module = lora_modules(actor)["decoder.layers.0.self_attention.linear_proj.weight"]
    ref = module.weight.double() + ALPHA / RANK * module.lora_B.double() @ module.lora_A.double()
    bf16_merge = module.weight + ALPHA / RANK * (module.lora_B @ module.lora_A)  # all in bf16
    got = exported["model.layers.0.self_attn.o_proj.weight"]
    torch.save(
        {
            "exact": (got.double() - ref.to(torch.bfloat16).double()).abs().max().item(),
            "update": (got.double() - module.weight.double()).abs().max().item(),
            # elements that differ from the fp64 merge rounded once (fp32 merge: none)
            "bf16_merge_off": (bf16_merge != ref.to(torch.bfloat16)).sum().item(),
            "numel": got.numel(),
        },
        out_path,
    )


def _moe_body(rank, world, moe_dir, out_path):
    """A MoE actor takes adapters on attention (logits at init == base, bitwise); experts are refused."""
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.models.lora import LoraOptions
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    arch = read_hf_config(moe_dir)
    with pytest.raises(ValueError, match="is a MoE expert"):
        build_policy(
            arch, tp=1, pp=1, init_weights=False, experts=ExpertOptions(), lora=LoraOptions(rank=RANK, alpha=ALPHA)
        )
    lora = build_policy(
        arch,
        tp=1,
        pp=1,
        init_weights=False,
        experts=ExpertOptions(),
        lora=LoraOptions(rank=RANK, alpha=ALPHA, targets=("linear_qkv", "linear_proj")),
    )
    base = build_policy(arch, tp=1, pp=1, init_weights=False, experts=ExpertOptions())
    for m in (lora, base):
        load_hf_weights(m, moe_dir)
    ids = torch.randint(4, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        equal = torch.equal(lora.full_logits(lora.run(ids)), base.full_logits(base.run(ids)))
    torch.save({"equal": equal, "adapted": sum(n.endswith("lora_A") for n, _ in lora.named_parameters())}, out_path)


# ---- launches -------------------------------------------------------------------------------------

UPDATE_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2)]  # tp, pp, dp (+ tp2 with SP)


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):
    top = str(tmp_path_factory.mktemp("lora"))
    cases = {1: {}, 2: {}, 4: {}}

    def out(name):
        return os.path.join(top, name + ".pt")

    for world in (1, 2):
        cases[world][f"init-{world}"] = (_init_body, (model_dir, out(f"init-{world}")))
    cases[1]["bf16"] = (_bf16_body, (model_dir, out("bf16")))
    moe_dir = make_tiny_model(
        os.path.join(top, "moe"),
        "qwen3_moe",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=32,
        vocab=300,
        experts=4,
        top_k=2,
        seed=10,
    )
    cases[1]["moe"] = (_moe_body, (moe_dir, out("moe")))
    for tp, pp, dp in UPDATE_LAYOUTS:
        name = f"update-{tp}{pp}{dp}"
        cases[tp * pp * dp][name] = (_update_body, (model_dir, tp, pp, out(name)))
    cases[2]["update-211-sp"] = (_update_body, (model_dir, 2, 1, out("update-211-sp"), True))
    cases[2]["update-121-full"] = (_update_body, (model_dir, 1, 2, out("update-121-full"), False, "full"))
    for tp, pp in ((2, 1), (1, 2)):
        cases[2][f"reference-{tp}{pp}"] = (_reference_body, (model_dir, tp, pp, out(f"reference-{tp}{pp}")))
    cases[2]["engine"] = (_engine_body, (model_dir, out("engine")))
    cases[2]["resume"] = (_resume_body, (model_dir, top, out("resume")))
    for name, tp, pp in (("resume-tp1", 1, 1), ("resume-pp2", 1, 2)):  # after "resume", which saves
        cases[2][name] = (_resume_other_layout_body, (model_dir, out("resume"), out(name), tp, pp))
    cases[2]["convert"] = (_convert_body, (model_dir, top, out("convert")))
    cases[4]["peft"] = (_peft_body, (model_dir, top, out("peft")))
    launches = SharedLaunches(cases, top)

    def result(name):
        launches.check(name)
        path = out(name)
        return torch.load(path) if os.path.exists(path) else None

    return result


@pytest.mark.slow
def test_lora_at_init_is_the_base_model_bitwise_and_merge_is_fp64_exact(launched):
    for world in (1, 2):
        assert launched(f"init-{world}")["merge_err"] < 1e-5


@pytest.mark.slow
def test_bf16_export_rounds_the_fp32_merge_once(launched):
    out = launched("bf16")
    print(f"lora bf16: {out}")
    assert out["update"] > 0, "the adapters must change the exported weight for this test to mean anything"
    assert out["exact"] == 0.0, out  # == the fp64 merge rounded to bf16 once
    assert out["bf16_merge_off"] > 0, out  # the check would see a bf16 merge


@pytest.mark.slow
def test_moe_actor_takes_attention_adapters_and_refuses_expert_ones(launched):
    out = launched("moe")
    assert out["equal"] and out["adapted"] == 2 * 2, out  # qkv + proj in 2 layers


@pytest.mark.slow
def test_update_across_layouts_equals_world_one_and_moves_only_adapters(launched):
    base = launched("update-111")
    for name in [f"update-{tp}{pp}{dp}" for tp, pp, dp in UPDATE_LAYOUTS[1:]] + ["update-211-sp", "update-121-full"]:
        other = launched(name)
        for k in range(2):
            for key in ("loss", "grad_norm"):
                assert abs(other["stats"][k][key] - base["stats"][k][key]) < 1e-5, (name, k, key)
        worst = max((other["weights"][n] - base["weights"][n]).abs().max().item() for n in base["weights"])
        print(
            f"lora {name}: merged weights vs world 1 {worst:.2e}, loss "
            f"{[abs(other['stats'][k]['loss'] - base['stats'][k]['loss']) for k in range(2)]}, grad norm "
            f"{[abs(other['stats'][k]['grad_norm'] - base['stats'][k]['grad_norm']) for k in range(2)]}"
        )
        assert worst < 1e-5, (name, worst)
    assert base["stats"][1]["grad_norm"] > 0


@pytest.mark.slow
def test_reference_from_disabled_adapters_equals_a_reference_model(launched):
    for layout in ("21", "12"):  # tp2, pp2
        out = launched(f"reference-{layout}")
        print(f"lora reference-{layout}: {out}")
        assert out["moved"] > 1e-3, "the adapters must change the actor for this test to mean anything"
        assert out["gap"] < 1e-6, out


@pytest.mark.slow
def test_native_engine_after_sync_from_tp2_lora_actor(launched):
    out = launched("engine")
    print(f"lora engine: {out}")
    assert out["adapter_effect"] > 1e-2, "the adapters must change the log-probs for this test to mean anything"
    assert out["gap"] < 1e-5, out


@pytest.mark.slow
def test_checkpoint_resume_is_exact_at_tp2(launched):
    assert launched("resume")["ok"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp1", "pp2"])
def test_tp2_checkpoint_resumes_at_another_layout(launched, layout):
    out = launched(f"resume-{layout}")
    print(f"lora resume-{layout}: {out}")
    for key in ("loss", "grad_norm"):
        assert abs(out["got"][key] - out["want"][key]) < 1e-5, (key, out)


@pytest.mark.slow
def test_converter_exports_the_merged_weights_of_a_lora_checkpoint(launched):
    out = launched("convert")
    print(f"lora convert: {out}")
    assert out["moved"] > 1e-2, "the adapters must change the weights for this test to mean anything"
    assert out["worst"][2] == 0.0 and out["worst"][1] < 1e-6, out


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor.lora_targets=[linear_qkv,q_proj]"], "is not one of linear_qkv"),
        (["actor.lora_rank=-1"], "actor.lora_rank=-1 must be >= 0"),
        (["actor.lora_alpha=0"], "actor.lora_alpha=0.0 must be > 0"),
        (["actor.lora_dropout=1.5"], r"actor.lora_dropout=1.5 must be in \[0, 1\)"),
        (["actor.lora_dropout=0.1", "actor.tp=2"], "set actor.lora_dropout=0 or actor.sequence_parallel=true"),
        (["actor.lora_targets=[]"], "is empty"),
        (["reference.model=/x"], "unset reference.model"),
    ],
)
def test_bad_lora_config_is_one_line(overrides, message):
    from remax_megatron.config import load_config

    with pytest.raises(ValueError, match=message) as e:
        load_config(None, ["reward.functions=[exact_match]", "actor.lora_rank=4", *overrides])
    assert "\n" not in str(e.value)


def test_lora_off_keeps_kl_needing_a_reference_and_lora_on_does_not():
    from remax_megatron.config import load_config

    with pytest.raises(ValueError, match="needs a reference model"):
        load_config(None, ["reward.functions=[exact_match]", "algo.kl_coef=0.1"])
    load_config(None, ["reward.functions=[exact_match]", "algo.kl_coef=0.1", "actor.lora_rank=4"])


def test_what_transformer_engine_would_run_is_refused_or_avoided(monkeypatch):
    """On a GPU with Transformer Engine a LoRA actor still runs megatron's local spec: packed rows run through
    its SDPA attention (THD, any dtype), and MoE experts default to megatron's SequentialMLP (auto) or are
    refused (grouped)."""
    from types import SimpleNamespace

    from remax_megatron import startup
    from remax_megatron.config import load_config

    from remax_megatron.models import arch

    monkeypatch.setattr(arch, "transformer_engine_usable", lambda: True)  # expert_options' (its owner's)
    base = ["reward.functions=[exact_match]", "actor.lora_rank=4"]
    dense = SimpleNamespace(is_moe=False, architecture="LlamaForCausalLM")
    moe = SimpleNamespace(is_moe=True, architecture="MixtralForCausalLM")
    cfg = load_config(None, [*base, "trainer.pack_sequences=true", "trainer.micro_batch_tokens=4096"])
    startup.check_lora(cfg, dense)
    arch.check_packing(torch.float32, local_spec=True)
    cfg = load_config(None, [*base, "actor.lora_targets=[linear_qkv]", "actor.moe_experts=grouped"])
    with pytest.raises(ValueError, match="use actor.moe_experts=sequential or auto"):
        startup.check_lora(cfg, moe)
    cfg = load_config(None, [*base, "actor.lora_targets=[linear_qkv]"])
    startup.check_lora(cfg, moe)
    assert startup.expert_options(cfg, moe).grouped_gemm is False
    cfg.actor.lora_rank = 0
    assert startup.expert_options(cfg, moe).grouped_gemm is True  # unchanged without LoRA


def test_moe_experts_are_refused():
    from types import SimpleNamespace

    from remax_megatron.config import load_config
    from remax_megatron.startup import check_lora

    cfg = load_config(None, ["reward.functions=[exact_match]", "actor.lora_rank=4"])
    moe = SimpleNamespace(is_moe=True, architecture="MixtralForCausalLM")
    with pytest.raises(ValueError, match="MoE experts in MixtralForCausalLM"):
        check_lora(cfg, moe)
    cfg.actor.lora_targets = ["linear_qkv", "linear_proj"]
    check_lora(cfg, moe)


def _vllm_body(rank, world, model_dir, out_path):
    """TP2 LoRA actor -> vLLM CPU engines (rollout.tp=1, one per rank) through WeightSync: prompt log-probs
    vs the actor's, fp32."""
    from remax_megatron.config import RolloutConfig
    from remax_megatron.models.lora import adapters_disabled
    from remax_megatron.rollout import WeightSync, build_engine
    from tests.rollout.test_vllm_engine import engine_score

    trainer, actor, _ = _trainer(world, model_dir, world, 1)
    random_adapters(actor, trainer.groups.tp_rank)
    engine = build_engine(
        RolloutConfig(engine="vllm", tp=1, kv_cache_gib=0.05),
        hf_dir=model_dir,
        arch=actor.arch,
        seed=0,
        dtype=torch.float32,
        max_model_len=64,
    )
    WeightSync(engine, actor, bucket_mb=0.05, groups=trainer.groups)()
    batch = _batch()
    batch["labels"][:, -1] = -100  # the engine scores tokens 1.. of each row
    plan = trainer.updater.micro_batch_plan(batch)[1]
    actor_lp = trainer.updater.logprobs(actor, batch, plan)
    with adapters_disabled(actor):
        base_lp = trainer.updater.logprobs(actor, batch, plan)
    engine_lp = engine_score(engine, batch["input_ids"], batch["labels"])
    mask = batch["labels"] != -100
    if rank == 0:
        torch.save(
            {
                "gap": (actor_lp - engine_lp)[mask].abs().max().item(),
                "adapter_effect": (actor_lp - base_lp)[mask].abs().max().item(),
            },
            out_path,
        )


@pytest.mark.slow
def test_vllm_engine_after_sync_from_tp2_lora_actor(tmp_path):
    pytest.importorskip("vllm")
    from tests._dist import run_distributed

    # head size 32: vLLM's CPU attention runs it (16 it refuses)
    model_dir = make_tiny_model(
        str(tmp_path / "llama"), "llama", hidden=128, layers=2, heads=4, kv_heads=2, ffn=96, tie=True, seed=5
    )
    out_path = str(tmp_path / "vllm.pt")
    run_distributed(_vllm_body, world_size=2, args=(model_dir, out_path))
    out = torch.load(out_path)
    print(f"lora vllm: {out}")
    assert out["adapter_effect"] > 1e-2, "the adapters must change the log-probs for this test to mean anything"
    assert out["gap"] < 1e-5, out


@pytest.mark.slow
def test_peft_export_loads_onto_the_base_model_with_the_actors_logits(launched, model_dir):
    """Issue 37: the adapters of a TP2 x PP2 LoRA checkpoint as a PEFT directory: peft.PeftModel.from_pretrained
    on the base HF model gives the logits of the actor's merged weights (what the engine runs) within 1e-5,
    every adapted module of every layer is there, and the adapters moved the model (not a no-op)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved = launched("peft")
    adapter = saved["adapter"]
    config = json.load(open(os.path.join(adapter, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(5))
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        plain = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, adapter).eval()(ids).logits
    merged = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    missing, unexpected = merged.load_state_dict(saved["merged"], strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # tied: lm_head = embed
    with torch.no_grad():
        actor = merged(ids).logits
    assert (peft_logits - actor).abs().max().item() < 1e-5
    assert (plain - actor).abs().max().item() > 1e-3
    layers = json.load(open(os.path.join(model_dir, "config.json")))["num_hidden_layers"]
    from safetensors.torch import load_file

    names = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert len(names) == layers * 7 * 2  # q, k, v, o, gate, up, down: lora_A and lora_B each
