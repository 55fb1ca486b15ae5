"""Make a tiny Hugging Face-format model and an SFT data set on the fly, from files every Python has.

`shardlm make-debug-hf OUT` writes OUT/model/ (config.json, sharded safetensors + index, tokenizer.json,
tokenizer_config.json with a chat template) and OUT/sft.jsonl (prompt/completion pairs: a function's
signature -> the first line of its docstring, from the standard library). `configs/debug_lora.toml`
fine-tunes that model with LoRA on CPU; tests use the same files. Needs the [hf] extra.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from shardlm.data.sources import builtin_files
from shardlm.extras import quiet_imports, require

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% if m['role'] == 'assistant' %}"
    "{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _stdlib_files(limit: int) -> list[Path]:
    """The first `limit` top-level stdlib modules (sorted by name): the same files on every machine."""
    return builtin_files(max_depth=0)[:limit]


def sft_pairs(max_pairs: int = 3000) -> list[dict]:
    """(signature -> first docstring line) for public functions of the stdlib's top-level modules."""
    pairs: list[dict] = []
    for f in _stdlib_files(400):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and 10 <= len(doc.split("\n")[0]) <= 200:
                    sig = f"def {node.name}({ast.unparse(node.args)}):"
                    pairs.append({"prompt": f"What does this function in {f.stem} do?\n{sig}",
                                  "completion": doc.split("\n")[0].strip()})
                    if len(pairs) >= max_pairs:
                        return pairs
    return pairs


def make_tokenizer(out: Path, vocab_size: int = 512) -> None:
    """A byte-level BPE trained on some stdlib text, with chat special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [f.read_text(encoding="utf-8", errors="ignore") for f in _stdlib_files(60)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))


def make_tiny_hf(out: Path, arch: str = "llama", seed: int = 0, max_shard_size: str = "200KB") -> Path:
    """A randomly initialised tiny model of `arch` (llama | qwen2 | qwen3), saved sharded, with tokenizer."""
    import torch

    transformers = require("transformers", "hf", "`shardlm make-debug-hf`")  # before anything is written
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    common = dict(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=352,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2, eos_token_id=eos, bos_token_id=eos)
    with quiet_imports():  # transformers imports its model classes (and, where installed, torchao) lazily
        cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
        torch.manual_seed(seed)
        model = cls[1](cls[0](**common)).float()
        model.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    return out


def make_debug_hf(root: Path) -> tuple[Path, Path]:
    """root/model (tiny HF llama + tokenizer) and root/sft.jsonl."""
    model_dir = make_tiny_hf(root / "model")
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in sft_pairs()))
    return model_dir, data
