"""Resuming a run: does the config given fit the checkpoint? Checked before anything is built.

    check_resume(cfg, path, read_trainer_state(path), model_dir, tokenizer, train_prompts)  # ValueError

What a resume takes from the checkpoint: the step count, weights, optimizer state, data-loader
position, RNG and KL controller. What it takes from the config: everything else, the learning-rate
schedule included (optimizer.build_scheduler overrides the checkpoint's; the trainer says once what
differs). Two things cannot simply follow the config:

- the model: a checkpoint's weights belong to the model it was trained from. Resuming it with
  another `actor.model` of the same shapes would train the checkpoint's weights under the new
  directory's name, config and tokenizer. Every checkpoint records `model_fingerprint` of its
  model; a different one is refused unless `checkpoint.allow_model_change=true`.
- the data: the checkpoint's data-loader position must lie within the prompts loaded now.
- the library: a checkpoint written by a newer megatron-core than the installed one is refused
  (weights/provenance.py: older releases cannot read newer ones' checkpoints).
"""

from __future__ import annotations

import hashlib
import json
import os

from remax_megatron.checkpoint import TRAINER_STATE
from remax_megatron.data.prompts import PromptSampler
from remax_megatron.weights.provenance import META, check_readable

# config.json keys that say who wrote the file, not what the model is.
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")
SAMPLED_BYTES = 1 << 20  # of each weight file, at its start and its end
FINGERPRINT_PARTS = {"config": "config.json", "tokenizer": "tokenizer", "weights": "weights"}  # compared at resume


def read_trainer_state(path: str) -> dict:
    with open(os.path.join(path, TRAINER_STATE)) as f:
        return json.load(f)


def model_fingerprint(spec: str, model_dir: str, tokenizer) -> dict:
    """What identifies the model `spec` (actor.model as given) resolved to `model_dir`: digests of its
    config.json (less who wrote it), of its tokenizer's vocabulary, and of its weights (each
    safetensors file's name, size, first and last MiB: enough to tell a base model from its
    fine-tune of the same shapes, without reading gigabytes). A built-in model's weights are its
    build recipe (the built bytes differ by CPU)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k not in VOLATILE_CONFIG_KEYS}
    vocab = sorted(tokenizer.get_vocab().items())
    specials = sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())
    if spec.startswith("builtin:"):
        from remax_megatron.builtin.models import recipe_hash

        weights = f"builtin:{recipe_hash(spec.split(':', 1)[1])}"
    else:
        weights = _digest(_weight_samples(model_dir))
    return {
        "model": spec,
        "config": _digest(json.dumps(config, sort_keys=True).encode()),
        "tokenizer": _digest(json.dumps([vocab, specials]).encode()),
        "weights": weights,
    }


def _weight_samples(model_dir: str):
    for name in sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors")):
        path = os.path.join(model_dir, name)
        size = os.path.getsize(path)
        yield f"{name}:{size}".encode()
        with open(path, "rb") as f:
            yield f.read(SAMPLED_BYTES)
            if size > SAMPLED_BYTES:
                f.seek(max(SAMPLED_BYTES, size - SAMPLED_BYTES))
                yield f.read(SAMPLED_BYTES)


def _digest(data) -> str:
    h = hashlib.sha256()
    for chunk in [data] if isinstance(data, bytes) else data:
        h.update(chunk)
    return h.hexdigest()[:16]


def check_resume(cfg, path: str, state: dict, model_dir: str, tokenizer, train_prompts: list) -> None:
    """ValueError (one line) when checkpoint `path` (its trainer state `state`) cannot be resumed with
    this config: written by a newer megatron-core than the installed one, another model (unless
    checkpoint.allow_model_change), or a data-loader position past the prompts loaded now."""
    check_readable(path)
    saved = state.get("model")  # absent in checkpoints written before it was recorded
    if saved and not cfg.checkpoint.allow_model_change:
        now = model_fingerprint(cfg.actor.model, model_dir, tokenizer)
        differ = [label for part, label in FINGERPRINT_PARTS.items() if saved.get(part) != now[part]]
        if differ:
            raise ValueError(
                f"checkpoint {path} was trained from actor.model={saved['model']}, and actor.model={cfg.actor.model} "
                f"is another model (its {', '.join(differ)} differ): resume with actor.model="
                f"{saved['model']}, start fresh with checkpoint.resume=none (or another trainer.output_dir), or set "
                "checkpoint.allow_model_change=true to train on the checkpoint's weights with this model's config "
                "and tokenizer"
            )
    check_lora_resume(cfg, path)
    try:
        PromptSampler(train_prompts, cfg.trainer.seed, cfg.data.shuffle).load_state_dict(state["sampler"])
    except ValueError as e:
        raise ValueError(f"checkpoint {path} cannot resume with data.train={cfg.data.train}: {e}") from None


def check_lora_resume(cfg, path: str) -> None:
    """The checkpoint's LoRA adapters (rank, alpha, targets: its remax_checkpoint.json) are this config's
    actor.lora_*; a full fine-tuning checkpoint resumes without them. ValueError (one line) otherwise."""
    meta = os.path.join(path, META)
    saved = None
    if os.path.isfile(meta):
        with open(meta) as f:
            saved = json.load(f).get("lora")
    a = cfg.actor
    now = {"rank": a.lora_rank, "alpha": a.lora_alpha, "targets": list(a.lora_targets)} if a.lora_rank else None
    if saved != now:

        def text(lora):
            return (
                f"lora_rank={lora['rank']}, lora_alpha={lora['alpha']:g}, lora_targets={lora['targets']}"
                if lora
                else "lora_rank=0 (no adapters)"
            )

        raise ValueError(
            f"checkpoint {path} was trained with actor.{text(saved)}, this config has actor.{text(now)}: "
            "resume with the checkpoint's LoRA settings, or start fresh with checkpoint.resume=none"
        )
