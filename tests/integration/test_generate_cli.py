"""`shardlm generate` as a user runs it, from an HF folder and from DCP checkpoints.

The model is `make_tiny_hf`'s llama (BPE tokenizer with a chat template, EOS declared in its configs). From it:
the `convert hf-to-dcp` import (model only), a full training-style checkpoint with LoRA adapters on q/v/down
(plus optimizer and trainer entries that generate must not read), and an adapters-only one. Greedy ids must
equal `transformers`' greedy `generate` on the HF folder, and, for the LoRA checkpoints (merged on the fly),
on the `convert dcp-to-hf --merge-lora` export. One torchrun run (2 gloo ranks, the model sharded, ranks in
lockstep) must give the ids of one process. One prompt's text streams to stdout (the pieces join up to the
--jsonl text) and Ctrl-C keeps what was printed (in this process, and a real SIGINT to a real process); a
request past the model's context (the same model with a 32-token config) stops there after one warning line,
and a prompt that fills it is one error line. Everything else runs in this process.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
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
SHORT = 32  # the context of assets["short"]
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
    short = tmp / "short"  # the same model and tokenizer with a 32-token context
    short.mkdir()
    for f in hf.iterdir():
        if f.name != "config.json":
            (short / f.name).symlink_to(f)
    config = json.loads((hf / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": SHORT}))
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "What does os.path.join do?"}]}) + "\n"
                       + json.dumps({"prompt": "def add(a, b):"}) + "\n")
    return {"hf": hf, "base": base_ck, "full": full, "only": only, "merged": tmp / "merged", "prompts": prompts,
            "short": short}


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
    assert recs[0]["prompt"] == "import os" and len(recs) == 3
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
                        f"--max-new-tokens={N}"], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
                       check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [json.loads(line)["ids"] for line in p.stdout.splitlines()] == [r["ids"] for r in one]  # rank 0 prints
    assert "on 2 ranks (FSDP)" in p.stderr and "LoRA r=4 merged" in p.stderr


def test_generate_errors_are_one_line(assets, capsys, tmp_path):
    assert main(["generate", "--hf", str(assets["hf"])]) == 2
    assert "generate needs a prompt" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"checkpoint {tmp_path / 'nope'} does not exist; pass a step-N directory" in err
    assert main(["generate", "--hf", str(assets["hf"]), "--prompt", "x", "--top-p", "1.5"]) == 2
    assert "--top-p" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in assets["hf"].iterdir():
        if f.name != "tokenizer.json":
            (bare / f.name).symlink_to(f)
    assert main(["generate", "--hf", str(bare), "--prompt", "x"]) == 2
    assert "no tokenizer.json; pass one with --tokenizer" in capsys.readouterr().err


class Pieces(io.StringIO):
    """A stdout that keeps each write apart; with `interrupt_at`, Ctrl-C arrives as that write is made."""

    def __init__(self, interrupt_at: int = 0):
        super().__init__()
        self.writes: list[str] = []
        self.interrupt_at = interrupt_at

    def write(self, s: str) -> int:
        self.writes.append(s)
        if len(self.writes) == self.interrupt_at:
            raise KeyboardInterrupt
        return super().write(s)


def test_one_prompt_streams_its_text_and_ctrl_c_keeps_it(assets, capsys, monkeypatch):
    (rec,) = _generate(capsys, "--hf", assets["hf"], "--prompt", "import os")
    assert rec["finish"] == "length" and rec["text"]
    out = Pieces()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "--hf", str(assets["hf"]), "--prompt", "import os", f"--max-new-tokens={N}"]) == 0
    assert len(out.writes) > 3 and "".join(out.writes) == rec["text"] + "\n"  # piece by piece: the same text
    assert "1 prompt, 16 new tokens (length) in" in capsys.readouterr().err
    out = Pieces(interrupt_at=3)  # Ctrl-C while the third piece is printed
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "--hf", str(assets["hf"]), "--prompt", "import os", f"--max-new-tokens={N}"]) == 130
    printed = "".join(out.writes[:2])
    assert rec["text"].startswith(printed) and out.writes[2:] == [out.writes[2], "\n"]  # kept, then the line ends
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("shardlm: generate interrupted after ")
    assert "; the text above is what was made" in err


def test_past_the_context_generation_stops_there_after_one_warning(assets, capsys):
    rc = main(["generate", "--hf", str(assets["short"]), "--prompt", "import os", "--max-new-tokens=1000", "--jsonl"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    (rec,) = [json.loads(line) for line in out.out.splitlines()]
    prompt, new = len(rec["prompt_ids"]), len(rec["ids"])
    assert prompt + new == SHORT and rec["finish"] == "context"
    want = (f"generate: warning: --max-new-tokens 1000 runs past the model's context of {SHORT} tokens (prompt "
            f"{prompt}): stopping at {new} new tokens; ask for at most {new} to fit")
    assert [line for line in out.err.splitlines() if "warning" in line] == [want]
    assert main(["generate", "--hf", str(assets["short"]), "--prompt", "import os", f"--max-new-tokens={new}"]) == 0
    assert "warning" not in capsys.readouterr().err  # it fits: no warning


def test_a_prompt_that_fills_the_context_is_one_error_line(assets, capsys):
    long = " ".join(["import os"] * SHORT)
    assert main(["generate", "--hf", str(assets["short"]), "--prompt", long, "--max-new-tokens=4"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("shardlm: error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert re.fullmatch(rf"shardlm: error: the prompt has \d+ tokens and the model's context is {SHORT}: no room for a "
                        rf"new token; shorten it to at most {SHORT - 1} tokens", errors[0])


def _read_some(stream, timeout: float) -> bytes:
    """The first bytes a child writes to `stream` (b"" if none come within `timeout` seconds)."""
    ready, _, _ = select.select([stream], [], [], timeout)
    return os.read(stream.fileno(), 4096) if ready else b""


@pytest.mark.slow
def test_sigint_to_a_real_process_keeps_the_streamed_text(assets):
    """A real Ctrl-C, sent once the first text has come out: without a KV cache 503 tokens take many seconds, so
    the signal lands mid-generation (the first bytes come before the end: that is what streaming means)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "shardlm", "generate", "--hf", str(assets["hf"]), "--prompt",
                          "import os", "--max-new-tokens", "100000000", "--no-cache"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        first = _read_some(p.stdout, timeout=300)
        assert first, "no text streamed before the end"
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err = err.decode()
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.splitlines()[-1].startswith("shardlm: generate interrupted after ")
    assert "runs past the model's context of 512 tokens (prompt 9): stopping at 503 new tokens" in err
    assert (first + rest).endswith(b"\n") and len(first + rest) > 1
