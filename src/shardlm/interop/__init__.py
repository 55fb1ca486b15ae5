"""Interop with other ecosystems' formats: `hf` (Hugging Face models and checkpoints), `peft` (LoRA adapters)."""
