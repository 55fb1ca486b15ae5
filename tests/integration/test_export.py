"""`shardlm convert dcp-to-hf` as a user runs it (in this process, no process group): atomic, checked
before it writes, complete (token ids, generation_config.json, tokenizer) and readable from any folder.

The base is `make_tiny_hf`'s llama with a BPE tokenizer, edited so that greedy decoding emits EOS right
after any prompt: every block adds nothing (o_proj and down_proj are zero), every embedding carries +10
in dimension 0 and only the EOS row of lm_head reads that dimension. `generate` then stops after one
token if, and only if, the exported folder tells it which id is EOS.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardlm.cli import main

transformers = pytest.importorskip("transformers")

MAX_NEW = 8


def _always_predicts(model, token: int) -> None:
    """Make an HF Llama predict `token` after any input: the blocks add nothing to the residual stream, every
    embedding carries 10 in dimension 0, and the head reads only that dimension, into `token`'s row."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[token, 0] = 1.0


def _eos_base(out: Path) -> tuple[Path, int]:
    from shardlm.assets.debug_hf import make_tiny_hf
    from tokenizers import Tokenizer

    raw = make_tiny_hf(out.with_name("raw"))
    eos = Tokenizer.from_file(str(raw / "tokenizer.json")).token_to_id("<|endoftext|>")
    model = transformers.AutoModelForCausalLM.from_pretrained(raw, dtype=torch.float32)
    _always_predicts(model, eos)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((raw / name).read_bytes())
    return out, eos


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(base HF folder, its EOS id, a shardlm checkpoint imported from it)."""
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    tmp = tmp_path_factory.mktemp("export")
    hf, eos = _eos_base(tmp / "base")
    ck = tmp / "run" / "checkpoints" / "step-0"
    import_hf_to_dcp(hf, ck)
    return hf, eos, ck


def _convert(*args, capsys=None) -> tuple[int, str]:
    rc = main(["convert", "dcp-to-hf", *map(str, args)])
    out = capsys.readouterr() if capsys is not None else None
    return rc, (out.out + out.err) if out is not None else ""


def _generated(folder: Path, prompt: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
    return ids[0, len(prompt):].tolist()


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_exported_folder_has_token_ids_and_generate_stops_at_eos(base, tmp_path, capsys):
    hf, eos, ck = base
    rc, said = _convert(ck, tmp_path / "out", "--dtype", "fp32", capsys=capsys)
    assert rc == 0, said
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    base_cfg = json.loads((hf / "config.json").read_text())
    assert cfg["eos_token_id"] == base_cfg["eos_token_id"] == eos and cfg["bos_token_id"] == base_cfg["bos_token_id"]
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == eos
    assert (tmp_path / "out" / "tokenizer.json").is_file() and f"eos {eos}" in said
    assert _generated(tmp_path / "out", [5, 6, 7]) == [eos]  # without the ids: MAX_NEW tokens, no stop

    # A base folder that records no ids (and no generation_config.json): they come from the tokenizer.
    bare = tmp_path / "bare"
    import shutil

    shutil.copytree(hf, bare)
    (bare / "generation_config.json").unlink()
    stripped = {k: v for k, v in base_cfg.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (bare / "config.json").write_text(json.dumps(stripped))
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    import_hf_to_dcp(bare, tmp_path / "ck_bare")
    rc, said = _convert(tmp_path / "ck_bare", tmp_path / "out_bare", "--dtype", "fp32", capsys=capsys)
    assert rc == 0, said
    cfg = json.loads((tmp_path / "out_bare" / "config.json").read_text())
    assert cfg["eos_token_id"] == eos and cfg["pad_token_id"] == eos  # tokenizer_config.json: pad = <|endoftext|>
    assert json.loads((tmp_path / "out_bare" / "generation_config.json").read_text())["eos_token_id"] == eos
    assert _generated(tmp_path / "out_bare", [5, 6, 7]) == [eos]


def test_a_failed_export_leaves_the_previous_one_as_it_was(base, tmp_path, capsys, monkeypatch):
    _, _, ck = base
    out = tmp_path / "out"
    assert _convert(ck, out, capsys=capsys)[0] == 0
    before = _digest(out)
    # Disk full while writing the weights: one line, the previous export intact, no temp folder left.
    import safetensors.torch

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full)
        rc, said = _convert(ck, out, "--dtype", "fp32", capsys=capsys)
    assert rc == 10 and f"export {out}: the disk of {tmp_path} is full (" in said and said.count("\n") == 1, said
    assert "the previous export is unchanged; free space on that disk" in said
    assert _digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # A check that fails (a tokenizer folder without tokenizer files) fails before any weight is written.
    (tmp_path / "notok").mkdir()
    rc, said = _convert(ck, out, "--tokenizer", tmp_path / "notok", capsys=capsys)
    assert rc == 2 and "holds none of tokenizer.json" in said
    assert _digest(out) == before and not any(p.name.startswith(".out.") for p in tmp_path.iterdir())


def test_what_a_killed_export_left_is_cleaned_or_restored(base, tmp_path, capsys):
    _, _, ck = base
    out = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".out.tmp-{host}-{dead.pid}"  # a kill mid-write
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    rc, said = _convert(ck, out, capsys=capsys)
    assert rc == 0 and not stale.exists() and f"removed {stale}" in said
    # A kill between the two renames of the swap: the previous export is moved aside, OUT is missing.
    before = _digest(out)
    aside = tmp_path / f".out.old-{host}-{dead.pid}"
    out.rename(aside)
    rc, said = _convert(ck, out, "--tokenizer", tmp_path / "nothing-here", capsys=capsys)  # fails its checks
    assert rc == 2 and "restored the previous export" in said and _digest(out) == before and not aside.exists()
    # A live export to the same folder (this process's pid stands in for it) is not touched.
    live = tmp_path / f".out.tmp-{host}-{os.getppid()}"
    live.mkdir()
    rc, said = _convert(ck, out, capsys=capsys)
    assert rc == 2 and "another export to" in said and live.is_dir() and _digest(out) == before


def test_a_folder_that_is_not_an_export_is_not_replaced(base, tmp_path, capsys):
    hf, _, ck = base
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.py").write_text("print('keep me')\n")
    rc, said = _convert(ck, mine, capsys=capsys)
    assert rc == 2 and "holds files an export does not write (train.py)" in said
    assert (mine / "train.py").read_text() == "print('keep me')\n" and len(list(mine.iterdir())) == 1
    for inside in (ck.parent, ck / "hf", hf):  # the run folder, inside the checkpoint, the base itself
        rc, said = _convert(ck, inside, capsys=capsys)
        assert rc == 2 and "which the export reads" in said, said
    assert (ck / ".metadata").is_file() and not (ck / "hf").exists()


def test_relative_paths_of_an_older_checkpoint_resolve_from_any_folder(base, tmp_path, capsys, monkeypatch):
    import shutil

    hf, eos, ck = base
    root = tmp_path / "project"  # the run started here, with model.init_from=hf:base
    shutil.copytree(hf, root / "base")
    old = root / "runs" / "x" / "checkpoints" / "step-0"
    shutil.copytree(ck, old)
    (old / "hf_source.json").write_text(json.dumps({"init_from": "hf:base", "tokenizer": "base"}))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    rc, said = _convert(old, "out", capsys=capsys)
    assert rc == 0, said
    out = tmp_path / "elsewhere" / "out"
    assert (out / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_position_embeddings"] == json.loads((hf / "config.json").read_text())["max_position_embeddings"]
    assert cfg["eos_token_id"] == eos


def test_byte_tokenizer_export_says_no_tokenizer_is_written(tmp_path, capsys):
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from shardlm.checkpoint.lineage import Record, RunFacts
    from shardlm.data.tokenizer import TokenizerRef
    from shardlm.checkpoint.meta import CheckpointMeta
    from shardlm.models import get_preset
    from shardlm.models.llama import Transformer

    cfg = dataclasses.replace(get_preset("debug"), max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    ck = tmp_path / "checkpoints" / "step-2"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ck), no_dist=True)
    CheckpointMeta(model=cfg).save(ck)
    (ck / "checkpoint.json").write_text(
        Record("a", 2, 1, facts=RunFacts(tokenizer=TokenizerRef.of("bytes").checkpoint_record())).to_json())
    rc, said = _convert(ck, tmp_path / "out", "--dtype", "fp32", capsys=capsys)
    assert rc == 0 and "no HF tokenizer written" in said and "256 is end-of-text" in said, said
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 256
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256
    assert not any((out / n).exists() for n in ("tokenizer.json", "tokenizer_config.json"))


def test_lora_flags_that_cannot_apply_are_one_line(base, tmp_path, capsys):
    """--merge-lora or --adapter-only on a checkpoint without adapters, or both at once, used to be accepted (the
    first two doing nothing): each is one line, exit 2, and nothing is written."""
    _, _, ck = base
    for flags, words in ((["--merge-lora"], "holds no LoRA adapters"), (["--adapter-only"], "holds no LoRA adapters"),
                         (["--merge-lora", "--adapter-only"], "opposite exports")):
        rc, out = _convert(ck, tmp_path / "x", *flags, capsys=capsys)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1 and words in lines[0], out
        assert not (tmp_path / "x").exists()


CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _chat_base(out: Path) -> tuple[Path, int]:
    """A tiny llama whose tokenizer ends turns with <|im_end|> (a chat template in chat_template.jinja, as
    transformers 5 saves it) and which answers any prompt with <|im_end|>."""
    from tokenizers import AddedToken, Tokenizer

    from shardlm.assets.debug_hf import make_tokenizer

    out.mkdir(parents=True)
    make_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    tok.save(str(out / "tokenizer.json"))
    tc = json.loads((out / "tokenizer_config.json").read_text())
    del tc["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    (out / "chat_template.jinja").write_text(CHATML)
    im_end, eos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=eos)
    model = transformers.LlamaForCausalLM(cfg).float()
    _always_predicts(model, im_end)
    model.save_pretrained(out, safe_serialization=True)
    return out, im_end


def test_a_chat_export_keeps_its_template_and_stops_at_the_end_of_a_turn(tmp_path, capsys):
    """`convert dcp-to-hf` used to drop chat_template.jinja (apply_chat_template then failed on the export) and to
    leave the template's end-of-turn token out of eos_token_id (transformers' generate ran past every answer)."""
    from transformers import AutoTokenizer

    from shardlm.config import load_config
    from shardlm.generate import generate_batch
    from shardlm.inference import load_for_inference
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    hf, im_end = _chat_base(tmp_path / "chat")
    ck = tmp_path / "ck"
    import_hf_to_dcp(hf, ck)
    rc, said = _convert(ck, tmp_path / "out", "--dtype", "fp32", capsys=capsys)
    assert rc == 0, said
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == CHATML
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert im_end in cfg["eos_token_id"] and im_end in gen["eos_token_id"], (cfg, gen)
    messages = [{"role": "user", "content": "What does os.path.join do?"}]
    prompt = AutoTokenizer.from_pretrained(tmp_path / "out").apply_chat_template(messages, add_generation_prompt=True,
                                                                                  tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    theirs = _generated(tmp_path / "out", prompt)
    inf = load_for_inference(checkpoint=ck, cfg=load_config(None, ["--train.device=cpu",
                                                                   "--train.mixed_precision=fp32"]))
    [ours] = generate_batch(inf.model, [prompt], MAX_NEW, stop_ids=inf.stop_ids)
    assert theirs == ours.ids == [im_end], (theirs, ours.ids)  # both stop after the end-of-turn token
