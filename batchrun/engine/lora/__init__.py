"""LoRA adapters per request: PEFT files, their place in the fused model, the resident set, the grouped update."""
from batchrun.engine.lora.resident import AdapterSet

__all__ = ["AdapterSet"]
