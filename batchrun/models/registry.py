"""model_type (from the checkpoint's config.json) -> the class that runs it. A new family: one file, one line here."""
from __future__ import annotations

from batchrun.models.gemma import Gemma2ForCausalLM, Gemma3TextForCausalLM
from batchrun.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from batchrun.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from batchrun.models.olmo2 import Olmo2ForCausalLM
from batchrun.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "phi3": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3TextForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_CLASSES)


def model_class(model_type: str):
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"model: architecture {model_type!r} is not supported; "
                         f"supported model_type values: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return MODEL_CLASSES[model_type]
