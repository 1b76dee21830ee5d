"""What a resume checks before anything is built (remax_megatron/resume.py):

- the model a checkpoint was made from: its fingerprint tells a same-shape other model (other
  weights, another config, a tokenizer with an added token) from a copy of the same one (moved
  elsewhere); another one is refused in one line unless checkpoint.allow_model_change; a checkpoint
  without a fingerprint (written before it was recorded) is not refused
- the data: a data-loader position past the prompts loaded now is refused in one line, naming
  data.train (the sampler itself refuses it too)

The whole run refused this way (exit 2, nothing written): tests/launch/test_run_ownership.py.
"""

import shutil

import pytest
from transformers import AutoTokenizer

from remax_megatron.config import load_config
from remax_megatron.data.prompts import PromptSampler
from remax_megatron.resume import check_resume, model_fingerprint
from tools.make_tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shape = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=96)
    base = make_tiny_model(str(root / "base"), "llama", seed=1, **shape)
    moved = shutil.copytree(base, root / "elsewhere" / "base")
    other = make_tiny_model(str(root / "other"), "llama", seed=2, **shape)  # a fine-tune: same shapes
    theta = make_tiny_model(str(root / "theta"), "llama", seed=1, rope_theta=500000.0, **shape)
    tokens = shutil.copytree(base, root / "tokens")
    tok = AutoTokenizer.from_pretrained(tokens)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(tokens)
    return {
        name: str(path) for name, path in dict(base=base, moved=moved, other=other, theta=theta, tokens=tokens).items()
    }


def _fingerprint(path):
    return model_fingerprint(path, path, AutoTokenizer.from_pretrained(path))


def test_the_fingerprint_tells_models_apart_and_ignores_where_they_are(models):
    base = _fingerprint(models["base"])
    assert {k: v for k, v in _fingerprint(models["moved"]).items() if k != "model"} == {
        k: v for k, v in base.items() if k != "model"
    }
    assert [k for k in ("config", "tokenizer", "weights") if _fingerprint(models["other"])[k] != base[k]] == ["weights"]
    assert [k for k in ("config", "tokenizer", "weights") if _fingerprint(models["theta"])[k] != base[k]] == [
        "config"
    ]  # same weights, another RoPE
    assert [k for k in ("config", "tokenizer", "weights") if _fingerprint(models["tokens"])[k] != base[k]] == [
        "tokenizer"
    ]


def _prompts(count):
    return [f"prompt {i}" for i in range(count)]


def _check(models, name, state, *overrides, prompts=80):
    cfg = load_config(None, ["reward.functions=[exact_match]", f"actor.model={models[name]}", *overrides])
    check_resume(
        cfg, "/ckpt/step_000004", state, models[name], AutoTokenizer.from_pretrained(models[name]), _prompts(prompts)
    )


def _state(models, position=16):
    return {"model": _fingerprint(models["base"]), "sampler": {"epoch": 0, "position": position, "size": 80}}


def test_another_model_is_refused_unless_allowed(models):
    _check(models, "base", _state(models))
    _check(models, "moved", _state(models))  # the same model in another directory
    with pytest.raises(ValueError) as refused:
        _check(models, "other", _state(models))
    assert str(refused.value) == (
        f"checkpoint /ckpt/step_000004 was trained from actor.model={models['base']}, and actor.model="
        f"{models['other']} is another model (its weights differ): resume with actor.model={models['base']}, start "
        "fresh with checkpoint.resume=none (or another trainer.output_dir), or set checkpoint.allow_model_change=true "
        "to train on the checkpoint's weights with this model's config and tokenizer"
    )
    with pytest.raises(ValueError, match="is another model \\(its tokenizer differ"):
        _check(models, "tokens", _state(models))
    _check(models, "other", _state(models), "checkpoint.allow_model_change=true")
    _check(models, "other", {"sampler": {"epoch": 0, "position": 16}})  # an older checkpoint: nothing to compare


def test_a_checkpoint_of_a_newer_megatron_core_is_refused_first(models, tmp_path):
    """Before the model and the data are compared (weights/provenance.py; the message: tests/weights)."""
    import json

    (tmp_path / "remax_checkpoint.json").write_text(json.dumps({"versions": {"megatron_core": "99.0.0"}}))
    cfg = load_config(None, ["reward.functions=[exact_match]", f"actor.model={models['other']}"])
    with pytest.raises(
        ValueError, match=f"checkpoint {tmp_path} was written by megatron-core 99.0.0 and the installed megatron-core "
    ):
        check_resume(
            cfg,
            str(tmp_path),
            _state(models),
            models["other"],
            AutoTokenizer.from_pretrained(models["other"]),
            _prompts(80),
        )


def test_a_position_past_the_prompts_is_refused(models):
    _check(models, "base", _state(models, position=40), prompts=40)  # at the end: the next epoch starts
    with pytest.raises(ValueError) as refused:
        _check(models, "base", _state(models, position=64), "data.train=/data/small.jsonl", prompts=40)
    assert str(refused.value) == (
        "checkpoint /ckpt/step_000004 cannot resume with data.train=/data/small.jsonl: its data-loader position 64 "
        "of 80 is past the end of the 40 train prompts loaded now: resume with the data it was trained on, or start "
        "fresh with checkpoint.resume=none"
    )
    with pytest.raises(ValueError, match="position 64 of 80 is past the end of the 40 train prompts"):
        PromptSampler(_prompts(40), 0).load_state_dict({"epoch": 1, "position": 64, "size": 80})
