"""Tied input and output embeddings (tie_word_embeddings=true) at TP2 and PP2, on gloo (issue 44).

At PP2 the last stage holds its own copy of the embedding as output weight (weights/mapping.py loads it
from embed_tokens; megatron's finalize_model_grads sums the two copies' gradients over the embedding
group so they stay equal); at TP2 the output weight is the embedding itself, vocab-parallel. Checked on a
tied Llama whose vocab (300) is not a multiple of 128 * TP (padding rows in both copies):
- before: the actor's logits == transformers' (< 1e-5, fp32);
- after one full fine-tuning update that moves the embedding: the last stage's output weight equals the
  first stage's embedding bitwise, and transformers on the exported weights (one embed_tokens, lm_head
  tied to it) gives the actor's logits (< 1e-5). Without the embedding gradient all-reduce (checked once
  by disabling it) the PP2 copies drift apart and both checks fail.
"""

import pytest
import torch

from tests._dist import SharedLaunches
from tools.make_tiny_model import make_tiny_model

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def _inputs(vocab):
    return torch.randint(4, vocab, (3, 17), generator=torch.Generator().manual_seed(0))


def _hf_logits(model_dir, ids, state_dict=None):
    """transformers' fp32 logits of ids, from model_dir or (state_dict) from exported weights over it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected and missing == ["lm_head.weight"], (missing, unexpected)  # tied: lm_head = embed
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        return model(ids).logits


def _actor_logits(actor, ids):
    """The actor's full logits on the last stage, None elsewhere."""
    from remax_megatron.models.forward import forward_only

    out = forward_only(actor, [{"input_ids": ids}], lambda m, hidden, batch: m.full_logits(hidden))
    return out[0] if out else None


def _tied_body(rank, world, model_dir, tp, pp):
    from remax_megatron.models import read_hf_config
    from remax_megatron.weights import export_hf_weights
    from tests.models.test_lora import _trainer
    from tests.train.test_update import _batch
    from tests.train.update_helpers import dp_share

    trainer, actor, _ = _trainer(world, model_dir, tp, pp, lora=False)  # full fine-tuning, lr 1e-2
    g = trainer.groups
    assert actor.share_embeddings_and_output_weights
    ids = _inputs(read_hf_config(model_dir).vocab_size)
    before = _actor_logits(actor, ids)
    if g.is_last_stage:
        err = (before - _hf_logits(model_dir, ids)).abs().max().item()
        assert err < 1e-5, f"tp={tp} pp={pp}: before the update, max |logits - transformers| = {err}"

    embedding = actor.shared_embedding_or_output_weight()  # first stage: the embedding; last: its copy
    start = embedding.detach().clone()
    trainer.updater.train_on(dp_share(trainer, _batch()), None, None)
    assert (embedding.detach() - start).abs().max().item() > 1e-4, "the update must move the embedding"
    if pp > 1:  # the last stage's output weight is still the first stage's embedding, bitwise
        copies = [torch.empty_like(embedding) for _ in range(pp)]
        torch.distributed.all_gather(copies, embedding.detach().contiguous(), group=g.pp)
        drift = (copies[-1] - copies[0]).abs().max().item()
        assert torch.equal(copies[0], copies[-1]), f"tp={tp} pp={pp}: output copy != embedding by {drift}"

    exported = {n: t.clone() for n, t in export_hf_weights(actor)}
    assert "lm_head.weight" not in exported
    after = _actor_logits(actor, ids)
    if g.is_last_stage:
        err = (after - _hf_logits(model_dir, ids, exported)).abs().max().item()
        assert err < 1e-5, f"tp={tp} pp={pp}: after the update, max |logits - transformers(export)| = {err}"
        assert (after - before).abs().max().item() > 1e-3


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Both layouts in one launch of 2 processes."""
    model_dir = make_tiny_model(
        str(tmp_path_factory.mktemp("tied") / "llama"),
        "llama",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=96,
        vocab=300,
        tie=True,
        seed=12,
    )
    cases = {2: {name: (_tied_body, (model_dir, tp, pp)) for name, (tp, pp) in LAYOUTS.items()}}
    return SharedLaunches(cases, str(tmp_path_factory.mktemp("launches")))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tied_embeddings_match_transformers_before_and_after_an_update(launched, layout):
    launched.check(layout)
