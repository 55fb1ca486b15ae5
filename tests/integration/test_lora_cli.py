"""LoRA SFT end to end through the CLI: a tiny HF model made on the fly -> 2 ranks -> resume -> export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _shardlm(*args: str, nproc: int = 0) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc else [sys.executable]
    p = subprocess.run(launcher + ["-m", "shardlm", *args], capture_output=True, text=True, env=ENV, cwd=ROOT,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def _records(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _train_args(assets: Path, out: Path, steps: int, **extra) -> list[str]:
    o = {"model.init_from": f"hf:{assets / 'model'}", "data.path": assets / "sft.jsonl", "train.steps": steps,
         "train.output_dir": out, "train.lr": 1e-2, "train.warmup_steps": 5, "metrics.log_every": 1,
         "checkpoint.interval": 10}
    o.update(extra)
    return ["train", "--config", str(ROOT / "configs" / "debug_lora.toml"), *[f"--{k}={v}" for k, v in o.items()]]


def _read_dcp(ck: Path) -> dict[str, torch.Tensor]:
    """Every model.* tensor of a checkpoint, read in this process (no process group)."""
    import torch.distributed.checkpoint as dcp

    from shardlm.checkpoint import SafeLoadPlanner

    meta = dcp.FileSystemReader(str(ck)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
          if k.startswith("model.") and hasattr(m, "size")}
    dcp.load(sd, checkpoint_id=str(ck), no_dist=True, planner=SafeLoadPlanner())
    return {k[len("model."):]: v for k, v in sd.items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    _shardlm("make-debug-hf", str(tmp / "assets"))
    p = _shardlm(*_train_args(tmp / "assets", tmp / "run", 20), nproc=2)
    return tmp, p


def test_lora_trains_and_only_adapters_change(run):
    tmp, p = run
    assert "LoRA r=8" in p.stdout and "sft data:" in p.stdout
    loss = _records(tmp / "run")
    assert loss[20] < loss[1] - 1.0, loss
    from safetensors.torch import load_file

    from shardlm.interop.hf.names import hf_key_to_ours

    base = {}
    for f in sorted((tmp / "assets" / "model").glob("*.safetensors")):
        base.update({hf_key_to_ours(k): v for k, v in load_file(f).items()})
    trained = _read_dcp(tmp / "run" / "checkpoints" / "step-20")
    lora = {k for k in trained if ".lora_" in k}
    assert len(lora) == 2 * 7 * 4  # A and B for 7 projections x 4 blocks
    for k, v in trained.items():
        if k in lora:
            continue
        assert torch.equal(v, base[k]), f"frozen {k} changed"
    assert any(trained[k].abs().sum() > 0 for k in lora if "lora_B" in k)  # the adapters did train


def test_resume_from_step_10_reproduces_the_run(run):
    tmp, _ = run
    ck = tmp / "run" / "checkpoints" / "step-10"
    _shardlm(*_train_args(tmp / "assets", tmp / "resumed", 20, **{"checkpoint.resume": ck}), nproc=2)
    straight, resumed = _records(tmp / "run"), _records(tmp / "resumed")
    assert min(resumed) == 11
    assert [resumed[s] for s in range(11, 21)] == [straight[s] for s in range(11, 21)]


def test_merged_export_equals_base_plus_peft_adapter(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, _ = run
    ck = tmp / "run" / "checkpoints" / "step-20"
    _shardlm("convert", "dcp-to-hf", str(ck), str(tmp / "merged"), "--merge-lora", "--dtype", "fp32")
    _shardlm("convert", "dcp-to-hf", str(ck), str(tmp / "adapter"), "--adapter-only")
    assert (tmp / "merged" / "tokenizer.json").is_file() and (tmp / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(tmp / "merged").eval()
    base = AutoModelForCausalLM.from_pretrained(tmp / "assets" / "model").eval()
    peft = PeftModel.from_pretrained(base, tmp / "adapter").eval()
    x = torch.randint(0, merged.config.vocab_size, (2, 48))
    with torch.no_grad():
        a, b = merged(x).logits, peft(x).logits
    # fp32: merging W + B@A*s rounds once per weight; relative to the logits' scale that is ~1e-6
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item() * 10
    assert merged.config.max_position_embeddings == base.config.max_position_embeddings


def test_adapters_only_checkpoints_are_small_and_resume(run):
    tmp, _ = run
    args = dict(**{"lora.adapters_only": "true", "checkpoint.interval": 5})
    _shardlm(*_train_args(tmp / "assets", tmp / "small", 5, **args), nproc=2)
    full = sum(f.stat().st_size for f in (tmp / "run" / "checkpoints" / "step-20").glob("*.distcp"))
    small = sum(f.stat().st_size for f in (tmp / "small" / "checkpoints" / "step-5").glob("*.distcp"))
    assert small < 0.35 * full, (small, full)
    p = _shardlm(*_train_args(tmp / "assets", tmp / "small", 8, **args), nproc=2)
    assert "resumed from" in p.stdout and min(_records(tmp / "small")) == 1 and max(_records(tmp / "small")) == 8


# -- one process, no torchrun: LoRA on a bf16 base and QLoRA train, export and plan (one GPU's setup) -------

def _width_256_model(model_dir: Path) -> None:
    """Replace make-debug-hf's model (dim 128: its k/v projections are not whole NF4 groups) with a dim-256 one
    of the same tokenizer, whose every linear holds whole NF4 groups (as the issue's QLoRA run used)."""
    import transformers

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    for f in model_dir.glob("*.safetensors*"):
        f.unlink()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(model_dir, safe_serialization=True)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    _shardlm("make-debug-hf", str(tmp / "assets"))
    _width_256_model(tmp / "assets" / "model")
    for base in ("bf16", "nf4"):  # plain `python -m shardlm train`: one process, no launcher
        _shardlm(*_train_args(tmp / "assets", tmp / base, 6, **{"lora.base_dtype": base, "checkpoint.interval": 6}))
    return tmp


@pytest.mark.parametrize("base", ["bf16", "nf4"])
def test_lora_and_qlora_train_export_and_plan_on_one_process(one_process, base):
    from transformers import AutoModelForCausalLM

    from shardlm.config import load_config
    from shardlm.inference import load_for_inference

    tmp = one_process
    loss = _records(tmp / base)
    assert sorted(loss) == list(range(1, 7)) and all(v == v for v in loss.values()), loss
    ck = tmp / base / "checkpoints" / "step-6"
    _shardlm("convert", "dcp-to-hf", str(ck), str(tmp / f"{base}-merged"), "--merge-lora", "--dtype", "fp32")
    theirs = AutoModelForCausalLM.from_pretrained(tmp / f"{base}-merged").eval()
    ours = load_for_inference(checkpoint=ck, cfg=load_config(None, ["--train.device=cpu",
                                                                    "--train.mixed_precision=fp32"]))
    x = torch.randint(0, theirs.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = theirs(x).logits, ours.model(x).float()
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item() * 10
    p = _shardlm("plan", "--config", str(ROOT / "configs" / "debug_lora.toml"), "--gpus-per-node", "1",
                 "--gpu-mem-gib", "24", f"--model.init_from=hf:{tmp / 'assets' / 'model'}",
                 f"--lora.base_dtype={base}", "--no-alternatives")
    assert "on 1 ranks" in p.stdout and f"(base {base})" in p.stdout and "FITS" in p.stdout, p.stdout
