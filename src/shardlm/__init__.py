"""shardlm: train and fine-tune Llama-family LLMs with PyTorch FSDP2."""

__version__ = "0.1.0"
