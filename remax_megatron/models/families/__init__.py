"""The model-family registry: HF architecture name -> the Family that serves it.

    family, task = lookup("Qwen3ForCausalLM", path)   # (Qwen3 family, "causal_lm"); ValueError otherwise
    family_named("qwen3")                             # by ModelArch.family
    register(MyFamily())                              # a new family: its own file plus this call

Each family is one file beside this one (base.py says what a family declares). Adding one touches
that file and the list below, nothing else: config reading, the weight mapping (load, export,
rollout sync, both converters), the planner's parameter count, tiny test models and the native rollout
engine's expert, router and routing-replay names all read it.
"""

from __future__ import annotations

from remax_megatron.models.families.base import CAUSAL_LM, DENSE_MLP, REWARD, EngineTensor, Family, MoeNames, TensorRule

_BY_NAME: dict[str, Family] = {}
_BY_ARCHITECTURE: dict[str, Family] = {}
# Architectures people ask for that no family can run exactly: refused with the reason, never approximated.
NOT_SUPPORTED = {
    "DeepseekV2ForCausalLM": "its softmax router with group-limited greedy top-k",
    "Qwen2MoeForCausalLM": "its shared expert with a sigmoid gate",
    "Qwen3NextForCausalLM": "its linear-attention (gated DeltaNet) layers and gated shared expert",
}


def register(family: Family) -> Family:
    """Add `family`; its name and architectures must be new (AssertionError: a programming mistake)."""
    assert family.name and family.architectures, f"{type(family).__name__} needs a name and architectures"
    assert family.name not in _BY_NAME, f"model family {family.name!r} is registered twice"
    for architecture, task in family.architectures.items():
        assert task in (CAUSAL_LM, REWARD), f"{architecture}: task {task!r}"
        assert architecture not in _BY_ARCHITECTURE, (
            f"{architecture} is served by {_BY_ARCHITECTURE[architecture].name!r} already"
        )
    _BY_NAME[family.name] = family
    _BY_ARCHITECTURE.update({a: family for a in family.architectures})
    return family


def unregister(name: str) -> None:
    """Remove a family (tests that register a toy one)."""
    family = _BY_NAME.pop(name)
    for architecture in family.architectures:
        del _BY_ARCHITECTURE[architecture]


def family_named(name: str) -> Family:
    if name not in _BY_NAME:
        raise ValueError(f"model family {name!r} is not registered: the registry has {', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[name]


def families() -> list[Family]:
    return list(_BY_NAME.values())


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def lookup(architecture: str, where: str) -> tuple[Family, str]:
    """(family, task) of an HF architecture name; ValueError naming the registry's families."""
    family = _BY_ARCHITECTURE.get(architecture)
    if family is None:
        listed = "; ".join(f"{f.name} ({', '.join(f.architectures)})" for f in _BY_NAME.values())
        why = f" ({NOT_SUPPORTED[architecture]} would be approximated)" if architecture in NOT_SUPPORTED else ""
        raise ValueError(
            f"unsupported architecture {architecture!r} in {where}{why}: remax-megatron's model families are {listed}"
        )
    return family, family.architectures[architecture]


def _register_builtin() -> None:
    from remax_megatron.models.families import deepseek_v3, glm4_moe, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe

    for module in (llama, qwen2, qwen3, mistral, qwen3_moe, mixtral, glm4_moe, deepseek_v3):
        register(module.FAMILY)
    from remax_megatron.models.families import gpt_oss

    register(gpt_oss.FAMILY)


_register_builtin()

__all__ = [
    "CAUSAL_LM",
    "DENSE_MLP",
    "REWARD",
    "EngineTensor",
    "Family",
    "MoeNames",
    "TensorRule",
    "families",
    "family_named",
    "lookup",
    "register",
    "supported_architectures",
    "unregister",
]
