from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from shardlm.models import PRESETS, ModelConfig, Transformer
from shardlm.observe.metrics import FIELDS, MetricsLogger, Throughput, peak_flops


@pytest.mark.parametrize("tie", [False, True])
def test_flops_formula_matches_flop_counter(tie):
    cfg = ModelConfig(**{**PRESETS["debug"].__dict__, "max_seq_len": 64, "tie_embeddings": tie})
    model = Transformer(cfg)
    model.init_weights(0)
    x = torch.randint(0, cfg.vocab_size, (2, 64))
    # The math SDPA backend is plain bmm, which the counter sees (the fused CPU kernel it doesn't).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    measured = counter.get_total_flops() / x.numel()
    assert cfg.flops_per_token(64) == pytest.approx(measured, rel=0.02)


def test_mfu_is_null_without_a_known_peak_and_computed_with_one():
    assert peak_flops(torch.device("cpu")) is None
    m = Throughput(flops_per_token=1e9, peak=1e12, world_size=2)
    m.add(1000)
    tps, mfu = m.measure()
    assert tps > 0 and mfu == pytest.approx(tps * 1e9 / 2e12)
    tps, mfu = Throughput(1e9, None, 1).measure()
    assert mfu is None


def test_metrics_jsonl_records(tmp_path, capsys):
    log = MetricsLogger(tmp_path, total_steps=2, enabled=True, progress_bar=False, tensorboard=False)
    rec = dict(zip(FIELDS, (1, 2.5, 1e-3, 0.7, 1234.0, None, 0.5, 1.0)))
    log.log(rec)
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == rec
    assert "step      1 | loss 2.5000" in capsys.readouterr().out


def test_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    log = MetricsLogger(tmp_path, total_steps=1, enabled=True, progress_bar=False, tensorboard=True)
    log.log(dict(zip(FIELDS, (1, 2.5, 1e-3, 0.7, 1234.0, None, 0.5, 1.0))))
    log.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_peak_memory_reader_on_cpu_is_the_peak_rss():
    from shardlm.observe.metrics import read_and_reset_peak_memory

    first = read_and_reset_peak_memory(torch.device("cpu"))["mem_gib"]
    assert 0 < first <= read_and_reset_peak_memory(torch.device("cpu"))["mem_gib"]  # peak RSS never goes down
