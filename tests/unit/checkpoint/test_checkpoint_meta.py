"""CheckpointMeta: the sidecar files of a checkpoint (model_config.json, lora_config.json, hf_source.json)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardlm.checkpoint.meta import HF_SOURCE_FILE, LORA_CONFIG_FILE, MODEL_CONFIG_FILE, CheckpointMeta
from shardlm.config import load_config
from shardlm.errors import CheckpointError
from shardlm.models import get_preset
from shardlm.resolve import tokenizer_spec


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
    meta = CheckpointMeta.from_config(cfg, mc, tokenizer_spec(cfg))
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
        "train_embeddings": False, "train_norms": False, "base": f"hf:{hf}"}
    assert json.loads((tmp_path / HF_SOURCE_FILE).read_text()) == {"init_from": f"hf:{hf}", "tokenizer": str(hf)}


def test_plain_run_writes_only_the_model_config(tmp_path):
    cfg = load_config(None, [])
    meta = CheckpointMeta.from_config(cfg, get_preset("debug"), tokenizer_spec(cfg))
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


def _saved(tmp_path, cfg, tokenizer=None):
    """A checkpoint folder holding `cfg`'s sidecars and a checkpoint.json with `tokenizer`'s fingerprint."""
    from shardlm.checkpoint.lineage import RECORD_FILE, Record, RunFacts

    ck = tmp_path / "ck" / "step-3"
    ck.mkdir(parents=True)
    CheckpointMeta.from_config(cfg, get_preset("debug"), tokenizer_spec(cfg)).save(ck)
    (ck / RECORD_FILE).write_text(Record("a", 3, 1, facts=RunFacts(tokenizer=tokenizer or None)).to_json())
    return ck


def _checker(cfg, tokenizer=None):
    from shardlm.checkpoint import Checkpointer
    from shardlm.checkpoint.lineage import RunFacts

    return Checkpointer(cfg.checkpoint, cfg.checkpoint.dir, 1, None, None, {}, log=lambda line: None, forms=(),
                        meta=CheckpointMeta.from_config(cfg, get_preset("debug"), tokenizer_spec(cfg)),
                        facts=RunFacts(tokenizer=tokenizer or None))


@pytest.mark.parametrize("change, field", [({"lora.alpha": 16.0}, "lora.alpha"),
                                           ({"lora.targets": "q_proj,k_proj"}, "lora.targets"),
                                           ({"lora.rank": 8}, "lora.rank"), ({"lora.dropout": 0.0}, "lora.dropout")])
def test_resume_check_names_each_changed_lora_field(tmp_path, change, field):
    from shardlm.errors import ConfigError

    cfg, _ = _lora_cfg(tmp_path)
    ck = _saved(tmp_path, cfg)
    new, _ = _lora_cfg(tmp_path, **change)
    with pytest.raises(ConfigError, match=rf"{field}: checkpoint .*--checkpoint.allow_changed={field}$"):
        _checker(new).check(ck)
    _checker(new).check(_saved(tmp_path / "same", new))  # the same setup passes
    allowed, _ = _lora_cfg(tmp_path, **change, **{"checkpoint.allow_changed": field})
    _checker(allowed).check(ck)  # allowed on purpose: passes (and is logged)


def test_resume_check_sees_a_changed_tokenizer_and_targets_order_is_not_a_change(tmp_path):
    from shardlm.errors import ConfigError

    cfg, _ = _lora_cfg(tmp_path)
    ck = _saved(tmp_path, cfg, tokenizer={"spec": "old.json", "sha256": "aa"})
    with pytest.raises(ConfigError, match=r"tokenizer: checkpoint 'old.json', this run 'new.json'"):
        _checker(cfg, tokenizer={"spec": "new.json", "sha256": "bb"}).check(ck)
    _checker(cfg, tokenizer={"spec": "moved.json", "sha256": "aa"}).check(ck)  # same bytes, other path: fine
    swapped, _ = _lora_cfg(tmp_path, **{"lora.targets": "v_proj,q_proj"})
    _checker(swapped).check(ck)
    with pytest.raises(ConfigError, match=r"checkpoint.allow_changed: unknown field\(s\) lora.colour; valid: "):
        _checker(load_config(None, ["--checkpoint.allow_changed=lora.colour"]))


def test_a_save_that_died_mid_swap_gets_its_checkpoint_back(tmp_path):
    """Re-saving step N moves step-N aside as .step-N.replaced, then renames the new one in: a death
    between the two renames must not lose the complete checkpoint (the next start used to delete it)."""
    from shardlm.checkpoint.manager import remove_partials

    (tmp_path / ".step-4.replaced").mkdir()
    (tmp_path / ".step-4.replaced" / ".metadata").write_text("complete")
    (tmp_path / ".step-6.partial").mkdir()
    (tmp_path / "step-2").mkdir()
    (tmp_path / ".step-2.replaced").mkdir()  # the swap finished: the old copy is only leftover
    said = []
    remove_partials(tmp_path, said.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]
    assert (tmp_path / "step-4" / ".metadata").read_text() == "complete"
    assert len(said) == 3 and any("restored step-4" in s for s in said)


def test_resume_check_names_the_data_source_whose_content_changed(tmp_path):
    """A source of the mixture swapped for another of the same size, or a file that grew: one line with both
    contents and the switch; the same content under another path of the cache is no change."""
    from shardlm.checkpoint.lineage import RECORD_FILE, Record, RunFacts
    from shardlm.checkpoint.meta import data_changes
    from shardlm.errors import ConfigError

    a = {"source": "a.jsonl", "documents": 600, "tokens": 60_000, "sha256": "aaaa"}
    b = {"source": "b.jsonl", "documents": 300, "tokens": 30_000, "sha256": "bbbb"}
    swapped = {"source": "c.jsonl", "documents": 300, "tokens": 30_000, "sha256": "cccc"}
    cfg = load_config(None, [])
    ck = _saved(tmp_path, cfg)
    (ck / RECORD_FILE).write_text(Record("a", 3, 1, facts=RunFacts(data=[a, b])).to_json())

    def check(data, allow=""):
        c = load_config(None, [f"--checkpoint.allow_changed={allow}"] if allow else [])
        from shardlm.checkpoint import Checkpointer

        said: list[str] = []
        Checkpointer(c.checkpoint, c.checkpoint.dir, 1, None, None, {}, log=said.append, forms=(),
                     meta=CheckpointMeta.from_config(c, get_preset("debug"), tokenizer_spec(c)),
                     facts=RunFacts(data=data)).check(ck)
        return said

    with pytest.raises(ConfigError, match=r"\(data: checkpoint 'source 2 b.jsonl: 300 documents, 30,000 tokens, "
                                          r"sha256 bbbb', this run 'source 2 c.jsonl: 300 documents, 30,000 tokens, "
                                          r"sha256 cccc'\).*--checkpoint.allow_changed=data$"):
        check([a, swapped])
    with pytest.raises(ConfigError, match=r"data: checkpoint '2 source\(s\) \[a.jsonl.*; b.jsonl.*\]', this run "
                                          r"'1 \[a.jsonl"):
        check([a])
    assert check([a, b]) == []  # the same data
    assert check([a, swapped], allow="data") == [
        "checkpoint: resuming with data changed from 'source 2 b.jsonl: 300 documents, 30,000 tokens, sha256 bbbb' "
        "to 'source 2 c.jsonl: 300 documents, 30,000 tokens, sha256 cccc' (checkpoint.allow_changed)"]
    # a checkpoint of an older version recorded no data: nothing to compare
    assert data_changes(None, [a]) is None and data_changes([a], [dict(a)]) is None
    grown = dict(a, tokens=60_100, sha256="dddd")
    assert data_changes([a], [grown]) == ("a.jsonl: 600 documents, 60,000 tokens, sha256 aaaa",
                                          "a.jsonl: 600 documents, 60,100 tokens, sha256 dddd")


def test_run_facts_round_trip_and_read_older_or_odd_records(tmp_path):
    """checkpoint.json's run facts come back typed as written; a field an older or hand-edited file lacks, or
    holds in another shape, reads as None instead of failing the resume or being trusted."""
    import json

    from shardlm.checkpoint.lineage import RECORD_FILE, Record, RunFacts, Schedule, new_record

    facts = RunFacts(world_size=4, global_batch=32, schedule=Schedule(100, (60, 0.25)),
                     tokenizer={"spec": "bytes", "sha256": "bytes"}, data=[{"source": "a", "tokens": 5}])
    (tmp_path / "step-1").mkdir()
    rec = new_record(tmp_path, 1, None, facts)
    (tmp_path / "step-1" / RECORD_FILE).write_text(rec.to_json())
    back = Record.read(tmp_path / "step-1")
    assert back is not None and back.facts.schedule == Schedule(100, (60, 0.25))
    assert (back.facts.world_size, back.facts.global_batch, back.facts.tokenizer, back.facts.data) == \
        (4, 32, facts.tokenizer, facts.data)
    assert back.facts.saved_at and back.facts.host and facts.saved_at is None  # stamped on the saved copy only
    odd = {"format": 1, "id": "x", "step": 2, "seq": 1, "world_size": "4", "global_batch": True,
           "schedule": {"steps": "100"}, "tokenizer": "bytes"}
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / RECORD_FILE).write_text(json.dumps(odd))
    assert Record.read(tmp_path / "step-2").facts == RunFacts()
