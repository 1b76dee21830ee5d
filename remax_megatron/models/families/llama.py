"""Llama (Llama 2, Llama 3.x; tied or untied embeddings, llama3 RoPE scaling): the reference decoder
that `Family`'s defaults describe."""

from remax_megatron.models.families.base import CAUSAL_LM, REWARD, Family


class Llama(Family):
    name = "llama"
    architectures = {"LlamaForCausalLM": CAUSAL_LM, "LlamaForSequenceClassification": REWARD}
    hf_config_class = "LlamaConfig"


FAMILY = Llama()
