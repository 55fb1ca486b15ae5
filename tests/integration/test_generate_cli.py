"""`shardlm generate` as a user runs it, from an HF folder and from DCP checkpoints.

The model is `make_tiny_hf`'s llama (BPE tokenizer with a chat template, EOS declared in its configs). From it:
the `convert hf-to-dcp` import (model only), a full training-style checkpoint with LoRA adapters on q/v/down
(plus optimizer and trainer entries that generate must not read), and an adapters-only one. Greedy ids must
equal `transformers`' greedy `generate` on the HF folder, and, for the LoRA checkpoints (merged on the fly),
on the `convert dcp-to-hf --merge-lora` export. One torchrun run (2 gloo ranks, the model sharded, ranks in
lockstep) must give the ids of one process. Everything else runs in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from shardlm.cli import main

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
N = 16
TARGETS = ("q_proj", "v_proj", "down_proj")


def _lora_checkpoints(hf: Path, base_ck: Path, tmp: Path) -> tuple[Path, Path]:
    """(a full checkpoint: base + adapters + optimizer/trainer entries, an adapters-only one)."""
    import torch.distributed.checkpoint as dcp

    from shardlm.checkpoint.meta import CheckpointMeta
    from shardlm.checkpoint.reader import SINGLE_PROCESS_WARNING, CheckpointReader
    from shardlm.config import LoraSection

    reader = CheckpointReader(base_ck)
    base = reader.read(list(reader.tensors))
    g = torch.Generator().manual_seed(0)
    adapters = {}
    for name, w in base.items():
        if name.rsplit(".", 2)[-2] in TARGETS:
            mod = name.removesuffix(".weight")
            adapters[f"{mod}.lora_A.weight"] = torch.randn(4, w.shape[1], generator=g) * 0.2
            adapters[f"{mod}.lora_B.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.2
    meta = CheckpointMeta.load(base_ck)
    full, only = tmp / "run" / "checkpoints" / "step-3", tmp / "adapters" / "checkpoints" / "step-3"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        dcp.save({"model": {**base, **adapters}, "optim": {"state.x.exp_avg": torch.ones(3)},
                  "trainer": {"step": torch.tensor(3)}}, checkpoint_id=str(full), no_dist=True)
        dcp.save({"model": dict(adapters)}, checkpoint_id=str(only), no_dist=True)
    for folder, adapters_only in ((full, False), (only, True)):
        lora = LoraSection(rank=4, alpha=8.0, targets=list(TARGETS), adapters_only=adapters_only)
        CheckpointMeta(model=meta.model, lora=lora, init_from=f"hf:{hf}", tokenizer=str(hf)).save(folder)
    return full, only


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from shardlm.assets.debug_hf import make_tiny_hf
    from shardlm.interop.hf.export import export_checkpoint
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    tmp = tmp_path_factory.mktemp("generate")
    hf = make_tiny_hf(tmp / "hf", arch="llama")
    base_ck = tmp / "imported"
    import_hf_to_dcp(hf, base_ck)
    full, only = _lora_checkpoints(hf, base_ck, tmp)
    export_checkpoint(full, tmp / "merged", merge_lora=True, dtype="fp32", log=lambda line: None)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "What does os.path.join do?"}]}) + "\n"
                       + json.dumps({"prompt": "def add(a, b):"}) + "\n")
    return {"hf": hf, "base": base_ck, "full": full, "only": only, "merged": tmp / "merged", "prompts": prompts}


def _generate(capsys, *args: str) -> list[dict]:
    rc = main(["generate", *map(str, args), "--jsonl", f"--max-new-tokens={N}"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    assert "tokens/s" in out.err
    return [json.loads(line) for line in out.out.splitlines()]


def _hf_greedy(folder: Path, records: list[dict]) -> list[list[int]]:
    """transformers' greedy generate on `folder` (its own generation_config: EOS), one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in records:
            ids = model.generate(torch.tensor([r["prompt_ids"]]), max_new_tokens=N, do_sample=False)
            out.append(ids[0, len(r["prompt_ids"]):].tolist())
    return out


def test_generate_from_an_hf_folder_equals_transformers(assets, capsys):
    from tokenizers import Tokenizer

    hf = assets["hf"]
    user = Tokenizer.from_file(str(hf / "tokenizer.json")).token_to_id("<|user|>")
    recs = _generate(capsys, "--hf", hf, "--prompt", "import os", "--prompts-file", assets["prompts"],
                     "--batch-size", "2")
    assert [r["prompt"] for r in recs][0] == "import os" and len(recs) == 3
    assert all(user in r["prompt_ids"] for r in recs)  # the tokenizer's chat template rendered them
    assert [r["ids"] for r in recs] == _hf_greedy(hf, recs)
    plain = _generate(capsys, "--hf", hf, "--prompt", "import os", "--no-chat-template")
    assert user not in plain[0]["prompt_ids"] and plain[0]["prompt_ids"] != recs[0]["prompt_ids"]
    assert [r["ids"] for r in plain] == _hf_greedy(hf, plain)
    assert recs[0]["text"] and all(r["finish"] in ("stop", "length") for r in recs)


@pytest.mark.slow
def test_generate_from_checkpoints_merges_lora_and_shards_under_torchrun(assets, capsys):
    prompt = ["--prompt", "def add(a, b):", "--prompt", "x"]
    base = _generate(capsys, "--checkpoint", assets["base"], *prompt)
    assert [r["ids"] for r in base] == [r["ids"] for r in _generate(capsys, "--hf", assets["hf"], *prompt)]
    merged = _generate(capsys, "--checkpoint", assets["full"], *prompt)
    assert [r["ids"] for r in merged] != [r["ids"] for r in base]  # the adapters change the output
    assert [r["ids"] for r in merged] == _hf_greedy(assets["merged"], merged)  # == the merged HF export
    only = _generate(capsys, "--checkpoint", assets["only"], *prompt)  # base from the recorded HF folder
    assert [r["ids"] for r in only] == [r["ids"] for r in merged]
    # Sharded over 2 gloo ranks, each reading its rows of the base and merging its rows, sampling (rank 0's draws
    # broadcast each step): the ids of one process. A wrong row of a merged weight would move the probabilities
    # and, over 2 x 16 draws, the ids.
    sampled = ["--temperature", "0.9", "--top-k", "40", "--seed", "5"]
    one = _generate(capsys, "--checkpoint", assets["full"], *prompt, *sampled)
    assert [r["ids"] for r in one] != [r["ids"] for r in merged]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                        "shardlm", "generate", "--checkpoint", str(assets["full"]), *prompt, *sampled, "--jsonl",
                        f"--max-new-tokens={N}"], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [json.loads(line)["ids"] for line in p.stdout.splitlines()] == [r["ids"] for r in one]  # rank 0 prints
    assert "on 2 ranks (FSDP)" in p.stderr and "LoRA r=4 merged" in p.stderr


def test_generate_errors_are_one_line(assets, capsys, tmp_path):
    assert main(["generate", "--hf", str(assets["hf"])]) == 2
    assert "generate needs a prompt" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a complete checkpoint" in err
    assert main(["generate", "--hf", str(assets["hf"]), "--prompt", "x", "--top-p", "1.5"]) == 2
    assert "--top-p" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in assets["hf"].iterdir():
        if f.name != "tokenizer.json":
            (bare / f.name).symlink_to(f)
    assert main(["generate", "--hf", str(bare), "--prompt", "x"]) == 2
    assert "no tokenizer.json; pass one with --tokenizer" in capsys.readouterr().err
