"""The one place that names the rollout engines: a registry, the config checks, construction.

    check_rollout(cfg.rollout, arch, world_size)      # before any work (one-line ValueErrors)
    engine = build_engine(cfg.rollout, hf_dir=actor_dir, arch=arch, seed=cfg.trainer.seed,
                          dtype=torch.float32, max_model_len=512)

A third engine is one `register_engine("name", "package.module:Class")` call (or an entry
in ENGINES) plus its own module: a `RolloutEngine` subclass whose constructor takes
`(cfg, *, hf_dir, seed, dtype, max_model_len)` and, optionally, a staticmethod
`check_config(cfg, arch, world_size)`. Engine modules are imported only when chosen, so a
machine without vLLM never imports it.
"""

from __future__ import annotations

import importlib

import torch

from remax_megatron.models import read_hf_config
from remax_megatron.models.hf_config import check_tp_heads
from remax_megatron.parallel.layout import check_rollout_tp
from remax_megatron.rollout.engine import RolloutEngine, world_size_and_rank

# name -> "module:Class" (imported on use) or the class itself
ENGINES: dict[str, str | type] = {
    "native": "remax_megatron.rollout.native:NativeEngine",
    "vllm": "remax_megatron.rollout.vllm_engine:VllmEngine",
}


def register_engine(name: str, engine: str | type) -> None:
    """Make `rollout.engine=<name>` build `engine` (a RolloutEngine subclass or "module:Class")."""
    ENGINES[name] = engine


def engine_class(name: str) -> type:
    """The RolloutEngine subclass registered as `name` (its module imported now)."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine={name!r} is not one of {', '.join(ENGINES)}")
    target = ENGINES[name]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    if not (isinstance(target, type) and issubclass(target, RolloutEngine)):
        raise TypeError(f"rollout engine {name!r} is {target!r}, not a RolloutEngine subclass")
    return target


def check_rollout(cfg, arch, world_size: int, this_machine: bool = True) -> None:
    """rollout.* against the world and the model (arch may be None: layout checks only).

    this_machine: also the engine's own checks of the machine it will run on (vLLM
    installed, head size, host memory); False for planning a cluster job elsewhere."""
    cls = engine_class(cfg.engine)
    if cfg.tp < 1:
        raise ValueError(f"rollout.tp={cfg.tp!r} must be >= 1")
    check_rollout_tp(cfg.tp, world_size)
    if arch is not None:
        check_tp_heads(arch, cfg.tp, "rollout.tp")
    check = getattr(cls, "check_config", None)
    if check is not None and this_machine:
        check(cfg, arch, world_size)


def build_engine(
    cfg, *, hf_dir: str, arch=None, seed: int = 0, dtype: torch.dtype = torch.float32, max_model_len: int | None = None
) -> RolloutEngine:
    """The engine named by `cfg.engine` (a RolloutConfig), its weights still to be synced.

    hf_dir: the HF model directory (config.json and tokenizer; weights are not read).
    arch:   the ModelArch of hf_dir (read from it when None) for the checks.
    seed:   trainer.seed (streams when generate gets no per-prompt seeds).
    dtype:  the engine's weight dtype (weight sync casts to it).
    max_model_len: longest prompt + completion the engine must hold (None: the model's limit).
    """
    if arch is None:
        arch = read_hf_config(hf_dir)
    check_rollout(cfg, arch, world_size_and_rank()[0])
    return engine_class(cfg.engine)(cfg, hf_dir=hf_dir, seed=seed, dtype=dtype, max_model_len=max_model_len)
