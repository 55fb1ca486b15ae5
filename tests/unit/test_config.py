from __future__ import annotations

import pytest

from shardlm.config import Config, describe, load_config, parse_overrides
from shardlm.errors import ConfigError
from shardlm.models import PRESETS
from shardlm.build import build_model_config


def test_defaults_toml_and_overrides_compose(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = 7\nlr = 1e-3\n[data]\nseq_len = 64\n')
    cfg = load_config(f, ["--train.steps=9", "--parallel.dp_replicate", "2", "--metrics.tensorboard=true",
                          "--model.n_layers=3"])
    assert (cfg.train.steps, cfg.train.lr, cfg.data.seq_len) == (9, 1e-3, 64)
    assert cfg.parallel.dp_replicate == 2 and cfg.metrics.tensorboard is True and cfg.model.n_layers == 3
    assert cfg.train.micro_batch_size == Config().train.micro_batch_size


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(None, ["--train.steps=5", "--train.output_dir=x", "--data.path=a.txt"])
    f = tmp_path / "resolved.toml"
    f.write_text(cfg.to_toml())
    assert load_config(f).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("args, needle", [
    (["--train.stepz=5"], "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
    (["--trian.steps=5"], "unknown config section 'trian'; did you mean 'train'?"),
    (["--train.steps=five"], "train.steps expects int, got 'five'"),
    (["--train.lr=fast"], "train.lr expects float"),
    (["--train.mixed_precision=fp16"], "train.mixed_precision must be one of 'auto', 'bf16', 'fp32'"),
    (["--metrics.tensorboard=maybe"], "metrics.tensorboard expects bool"),
    (["--train.steps=0"], "train.steps must be >= 1"),
    (["--parallel.dp_shard=0"], "parallel.dp_shard must be >= 1, -1 (fill) or auto"),
    (["--parallel.dp_replicate=0"], "parallel.dp_replicate must be >= 1 or auto"),
    (["--parallel.dp_shard=two"], "parallel.dp_shard expects int or 'auto', got 'two'"),
    (["--parallel.preflight=maybe"], "parallel.preflight expects bool or 'auto' | 'strict'"),
    (["--parallel.step_timeout_s=0"], "parallel.step_timeout_s must be > 0"),
    (["--env.set.9X=1"], "env.set: '9X' is not an environment variable name"),
    (["--train.steps"], "has no value"),
    (["steps=5"], "unexpected argument"),
])
def test_bad_overrides_are_one_clear_line(args, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_toml_types_and_keys(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = "10"\n')
    with pytest.raises(ConfigError, match="train.steps expects int, got '10'"):
        load_config(f)
    f.write_text('[train]\nlearning_rate = 1.0\n')
    with pytest.raises(ConfigError, match="unknown config key 'train.learning_rate'"):
        load_config(f)
    f.write_text('[train\nsteps = 1\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_int_accepted_for_float_but_not_bool_for_int(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nlr = 1\n")
    assert load_config(f).train.lr == 1.0
    f.write_text("[train]\nsteps = true\n")
    with pytest.raises(ConfigError, match="expects int"):
        load_config(f)


def test_unknown_preset_lists_valid_ones():
    cfg = load_config(None, ["--model.preset=llama3_7b"])
    with pytest.raises(ConfigError) as e:
        build_model_config(cfg, 257)
    assert "unknown model preset 'llama3_7b'" in str(e.value)
    for name in ("debug", "llama3_8b", "qwen3_0_6b"):
        assert name in str(e.value)


def test_model_overrides_and_vocab_check():
    cfg = load_config(None, ["--model.preset=llama3_8b", "--model.n_layers=2", "--data.seq_len=256"])
    mc = build_model_config(cfg, 1000)
    assert mc.n_layers == 2 and mc.dim == PRESETS["llama3_8b"].dim and mc.max_seq_len == 256
    with pytest.raises(ConfigError, match="tokenizer has 400 tokens but the model's vocab_size is 320"):
        build_model_config(load_config(None, []), 400)
    with pytest.raises(ConfigError, match="multiple of n_kv_heads"):
        build_model_config(load_config(None, ["--model.n_kv_heads=3"]), 257)


def test_parse_overrides_forms():
    assert parse_overrides(["--a.b=1", "--c.d", "x=y"]) == [("a.b", "1"), ("c.d", "x=y")]


def test_describe_documents_every_key():
    text = describe()
    for key in ("model.preset", "train.steps", "train.output_dir", "train.seed", "train.micro_batch_size",
                "train.grad_accum", "train.mixed_precision", "train.lr", "train.warmup_steps",
                "parallel.dp_shard", "parallel.dp_replicate", "data.path", "data.seq_len", "data.tokenizer",
                "metrics.log_every"):
        assert f"  {key} = " in text
    assert "_MISSING" not in text and "  lora.targets = ['q_proj', 'k_proj'," in text  # list defaults shown as such
    assert "empty = $XDG_CACHE_HOME/shardlm/tokens" in text  # where the cache really is (data/loader.py)


def test_mixed_precision_auto_is_fp32_on_cpu_bf16_on_gpus():
    t = Config().train
    assert t.mixed_precision == "auto" and t.precision("cpu") == "fp32" and t.precision("cuda") == "bf16"
    for explicit in ("bf16", "fp32", "fp8"):
        t.mixed_precision = explicit
        assert t.precision("cpu") == t.precision("cuda") == explicit


def test_shape_overrides_rederive_head_dim():
    mc = build_model_config(load_config(None, ["--model.dim=768", "--model.n_heads=12"]), 257)
    assert mc.head_dim == 64 and mc.n_kv_heads == 2
    q3 = build_model_config(load_config(None, ["--model.preset=qwen3_0_6b", "--model.n_layers=2"]), 257)
    assert q3.head_dim == 128  # explicit in the preset: kept


@pytest.mark.parametrize("key", ["train.lr", "train.eps", "train.grad_clip", "train.weight_decay", "train.beta1",
                                 "train.min_lr_ratio", "lora.alpha", "lora.dropout", "checkpoint.preempt_grace_s"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_every_float_key_rejects_nan_and_inf(tmp_path, key, bad):
    with pytest.raises(ConfigError, match=f"^{key} must be a finite number, got '{bad}'$"):
        load_config(None, [f"--{key}={bad}"])
    section, name = key.split(".")
    f = tmp_path / "c.toml"
    f.write_text(f"[{section}]\n{name} = {bad}\n")  # TOML has nan/inf literals too
    with pytest.raises(ConfigError, match=f"^{key} must be a finite number"):
        load_config(f)


def test_negative_seed_is_rejected():
    with pytest.raises(ConfigError, match="train.seed must be >= 0, got -1"):
        load_config(None, ["--train.seed=-1"])
    assert load_config(None, ["--train.seed=0"]).train.seed == 0


def test_seq_len_beyond_a_pretrained_context_warns_naming_both(tmp_path):
    import json

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=1e4)))
    for seq_len, expect in ((128, 0), (256, 1)):
        warned: list[str] = []
        cfg = load_config(None, [f"--model.init_from=hf:{hf}", f"--data.seq_len={seq_len}"])
        assert build_model_config(cfg, 257, warn=warned.append).max_seq_len == seq_len
        assert len(warned) == expect, warned
    assert "data.seq_len=256 is beyond max_position_embeddings=128 in" in warned[0]
    warned = []  # a model trained from scratch has no pretrained context to exceed
    build_model_config(load_config(None, ["--data.seq_len=1024"]), 257, warn=warned.append)
    assert warned == []


@pytest.mark.parametrize("typed", ["q_proj,v_proj", "[q_proj,v_proj]", '["q_proj", "v_proj"]', "['q_proj','v_proj']",
                                   "[ q_proj , v_proj ]"])
def test_list_keys_take_the_forms_users_type(typed):
    """`--lora.targets=[q_proj,v_proj]` used to become the targets '[q_proj' and 'v_proj]'."""
    assert load_config(None, [f"--lora.targets={typed}"]).lora.targets == ["q_proj", "v_proj"]


@pytest.mark.parametrize("weight, words", [("-1", "must be > 0, got -1"), ("nan", "must be a finite number"),
                                           ("inf", "must be a finite number"), ("0", "must be > 0")])
def test_a_bad_source_weight_names_the_weight(weight, words):
    """`--data.sources=a.jsonl:-1` used to say "data.path 'a.jsonl:-1' does not exist"."""
    with pytest.raises(ConfigError, match=f"data.sources.0.weight {words}") as e:
        load_config(None, [f"--data.sources=a.jsonl:{weight}"])
    assert "does not exist" not in str(e.value)
    cfg = load_config(None, ["--data.sources=a.jsonl:1e-3,store:/x/y:2:1.5"])
    assert [(s.path, s.weight, s.epochs) for s in cfg.data.sources] == [("a.jsonl", 0.001, None), ("store:/x/y", 2.0, 1.5)]
