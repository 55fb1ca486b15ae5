"""Validation details: a resumed run's final line names the best val_loss of the whole run (the part before the
resume read back from metrics.jsonl, up to the resume step; torn lines skipped); eval.max_tokens limits an SFT set
as it does a text one; token ids outside the vocabulary are one line."""

from __future__ import annotations

import json

from shardlm.eval.validation import best_logged


def test_best_logged_reads_the_run_before_the_resume(tmp_path):
    f = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "val_loss": 2.5}, {"step": 4, "val_loss": 2.1},
             {"step": 6, "val_loss": 1.9}]
    f.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 7, "val_lo')
    assert best_logged(f, up_to=4) == (2.1, 4)
    assert best_logged(f, up_to=10) == (1.9, 6)
    assert best_logged(f, up_to=1) is None
    assert best_logged(tmp_path / "missing.jsonl", up_to=5) is None


def _sft_store(d):
    from shardlm.data.store.prepare import prepare, sft_spec
    from shardlm.data.tokenizer import ByteTokenizer

    d.mkdir(parents=True, exist_ok=True)
    records = [{"prompt": f"what is {i} plus {i}?", "completion": f"{i} plus {i} is {2 * i}."} for i in range(200)]
    (d / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare(sft_spec([d / "sft.jsonl"], ByteTokenizer(), None), d / "store", workers=1, log=lambda _: None)
    from shardlm.data.store.format import TokenStore

    return TokenStore.open(d / "store"), ByteTokenizer()


def test_eval_max_tokens_limits_an_sft_set_too(tmp_path):
    """eval.max_tokens used to be ignored for SFT validation sets (the whole set was evaluated, silently)."""
    import torch

    from shardlm.config import load_config
    from shardlm.eval.validation import Validator

    store, tok = _sft_store(tmp_path)
    def validator(*args: str) -> Validator:
        cfg = load_config(None, ["--data.format=sft", "--data.seq_len=64", *args])
        return Validator(cfg.data, cfg.eval, store, tok, 0, 1, torch.device("cpu"),
                         micro_batch_size=cfg.train.micro_batch_size, loss_chunk_tokens=cfg.train.loss_chunk_tokens)

    whole, part = validator(), validator("--eval.max_tokens=640")
    assert whole.n_rows > 10 and part.n_rows == 10  # 640 // 64


def test_token_ids_outside_the_vocabulary_are_one_line():
    """Damaged store bytes would index past the embedding (a device-side assert kills a GPU job with no message):
    every micro-batch is checked on the host, labels' IGNORE_INDEX aside."""
    import pytest
    import torch

    from shardlm.data.order import check_ids
    from shardlm.errors import DataError

    x, y = torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, -100]])
    check_ids(x, y, 4, "s", 0)  # in range; -100 is no target
    for bad_x, bad_y, value in ((torch.tensor([[1, 9, 3]]), y, 9), (x, torch.tensor([[2, -7, -100]]), -7),
                                (x, torch.tensor([[2, 4, 1]]), 4)):
        with pytest.raises(DataError, match=f"token id {value} in the batch after sample 12 of s is outside the "
                                            r"model's vocabulary \(0..3\)") as e:
            check_ids(bad_x, bad_y, 4, "s", 12)
        assert "\n" not in str(e.value)
