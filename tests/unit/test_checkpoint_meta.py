"""CheckpointMeta: the sidecar files of a checkpoint (model_config.json, lora_config.json, hf_source.json)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardlm.checkpoint.meta import HF_SOURCE_FILE, LORA_CONFIG_FILE, MODEL_CONFIG_FILE, CheckpointMeta
from shardlm.config import load_config
from shardlm.errors import CheckpointError
from shardlm.models import get_preset


def _lora_cfg(tmp_path, **extra):
    hf = tmp_path / "base"
    hf.mkdir(exist_ok=True)
    (hf / "tokenizer.json").write_text("{}")
    o = {"model.init_from": f"hf:{hf}", "lora.rank": 4, "lora.alpha": 8.0, "lora.dropout": 0.1,
         "lora.targets": "q_proj,v_proj", **extra}
    return load_config(None, [f"--{k}={v}" for k, v in o.items()]), hf


def test_round_trip_with_lora_and_hf_source(tmp_path):
    cfg, hf = _lora_cfg(tmp_path)
    mc = get_preset("debug")
    meta = CheckpointMeta.from_config(cfg, mc)
    meta.save(tmp_path)
    back = CheckpointMeta.load(tmp_path)
    assert back == meta
    assert back.model == mc and back.hf_dir == hf and back.tokenizer_dir == hf
    assert back.lora.rank == 4 and back.lora.alpha == 8.0 and back.lora.targets == ["q_proj", "v_proj"]
    assert back.lora_scaling == 2.0
    # The JSON an older trainer wrote, key for key: old checkpoints read the same.
    assert json.loads((tmp_path / MODEL_CONFIG_FILE).read_text()) == json.loads(json.dumps(dataclasses.asdict(mc)))
    assert json.loads((tmp_path / LORA_CONFIG_FILE).read_text()) == {
        "rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["q_proj", "v_proj"], "adapters_only": False,
        "base": f"hf:{hf}"}
    assert json.loads((tmp_path / HF_SOURCE_FILE).read_text()) == {"init_from": f"hf:{hf}", "tokenizer": str(hf)}


def test_plain_run_writes_only_the_model_config(tmp_path):
    cfg = load_config(None, [])
    meta = CheckpointMeta.from_config(cfg, get_preset("debug"))
    meta.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL_CONFIG_FILE]
    back = CheckpointMeta.load(tmp_path)
    assert back == meta and back.lora is None and back.hf_dir is None and back.tokenizer_dir is None
    assert back.lora_scaling == 0.0


def test_absent_files_read_as_not_recorded(tmp_path):
    meta = CheckpointMeta.load(tmp_path)
    assert meta == CheckpointMeta(model=None)
    with pytest.raises(CheckpointError, match="no model_config.json"):
        meta.require_model(tmp_path)
    with pytest.raises(CheckpointError, match="no lora_config.json"):
        meta.require_lora(tmp_path)


@pytest.mark.parametrize("name, text, words", [
    (MODEL_CONFIG_FILE, "{not json", ["unreadable"]),
    (MODEL_CONFIG_FILE, json.dumps({"dim": 64, "bogus": 1}), ["unknown field", "bogus"]),
    (MODEL_CONFIG_FILE, "[1, 2]", ["JSON object"]),
    (LORA_CONFIG_FILE, json.dumps({"alpha": 8.0}), ["'rank'"]),
    (LORA_CONFIG_FILE, json.dumps({"rank": 4, "alpha": "x"}), ["'alpha'"]),
    (LORA_CONFIG_FILE, json.dumps({"rank": 4, "alpha": 8.0, "targets": "q_proj"}), ["'targets'"]),
    (HF_SOURCE_FILE, json.dumps({"init_from": 3}), ["init_from"]),
    (HF_SOURCE_FILE, json.dumps({"init_from": "/no/prefix", "tokenizer": None}), ["hf:/path"]),
])
def test_malformed_file_is_one_checkpoint_error(tmp_path, name, text, words):
    (tmp_path / name).write_text(text)
    with pytest.raises(CheckpointError) as e:
        CheckpointMeta.load(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and name in msg and all(w in msg for w in words), msg


def test_lora_base_is_the_source_when_hf_source_is_absent(tmp_path):
    (tmp_path / LORA_CONFIG_FILE).write_text(json.dumps({"rank": 2, "alpha": 4, "base": "hf:/models/x"}))
    meta = CheckpointMeta.load(tmp_path)
    assert str(meta.hf_dir) == "/models/x" and meta.lora.dropout == 0.0 and meta.lora.targets == []
