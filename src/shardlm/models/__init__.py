"""Models: plain PyTorch, no torch.distributed."""

from shardlm.models.llama import ModelConfig, RopeScaling, Transformer
from shardlm.models.presets import PRESETS, get_preset

__all__ = ["ModelConfig", "RopeScaling", "Transformer", "PRESETS", "get_preset"]
