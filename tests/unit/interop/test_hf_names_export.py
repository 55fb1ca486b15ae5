"""shardlm.interop.hf pieces on plain inputs: the one name/shape validator and the shard planner."""

from __future__ import annotations

import pytest

from shardlm.interop.hf.export import plan_shards
from shardlm.interop.hf.names import LORA_RE, split_lora, validate

WANT = {"model.embed_tokens.weight": (10, 4), "model.norm.weight": (4,), "lm_head.weight": (10, 4)}
TIED_WANT = {k: v for k, v in WANT.items() if k != "lm_head.weight"}


def test_validate_accepts_a_match_and_maps_each_name_to_itself():
    assert validate(dict(WANT), WANT, tied=False) == {k: k for k in WANT}


def test_validate_ignores_rope_buffers():
    stored = {**WANT, "model.layers.0.self_attn.rotary_emb.inv_freq": (2,)}
    assert validate(stored, WANT, tied=False) == {k: k for k in WANT}


@pytest.mark.parametrize("stored, pattern", [
    ({k: v for k, v in WANT.items() if k != "model.norm.weight"}, r"^missing tensor\(s\) model\.norm\.weight: "),
    ({**WANT, "model.layers.0.self_attn.o_proj.bias": (4,)}, r"^unexpected tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"),
    ({**WANT, "model.norm.weight": (3, 3)}, r"^tensor 'model\.norm\.weight' has shape \(3, 3\), expected \(4,\)"),
])
def test_validate_names_the_first_problem(stored, pattern):
    with pytest.raises(ValueError, match=pattern) as e:
        validate(stored, WANT, tied=False, against="config.json")
    assert "config.json" in str(e.value)


def test_validate_lists_at_most_five_missing():
    want = {f"w{i}": (1,) for i in range(8)}
    with pytest.raises(ValueError, match=r"missing tensor\(s\) w0, w1, w2, w3, w4 \(and 3 more\)"):
        validate({}, want, tied=False)


def test_validate_tied_head():
    # A tied source may duplicate the embedding as lm_head.weight: ignored ...
    assert validate(dict(WANT), TIED_WANT, tied=True) == {k: k for k in TIED_WANT}
    # ... and it feeds the embedding when that is absent (in either namespace).
    head_only = {"model.norm.weight": (4,), "lm_head.weight": (10, 4)}
    assert validate(head_only, TIED_WANT, tied=True)["model.embed_tokens.weight"] == "lm_head.weight"
    ours = {"embed_tokens.weight": (10, 4), "norm.weight": (4,)}
    assert validate({"norm.weight": (4,), "lm_head.weight": (10, 4)}, ours, tied=True)["embed_tokens.weight"] \
        == "lm_head.weight"
    # Untied: the same stray head is an error, and a missing embedding is missing.
    with pytest.raises(ValueError, match="unexpected tensor 'lm_head.weight'"):
        validate(dict(WANT), TIED_WANT, tied=False)
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.embed_tokens\.weight"):
        validate(head_only, TIED_WANT, tied=False)


def test_split_lora_pairs_and_refuses_a_lone_factor():
    names = ["layers.0.q_proj.weight", "layers.0.q_proj.lora_A.weight", "layers.0.q_proj.lora_B.weight", "norm.weight"]
    base, pairs = split_lora(names)
    assert base == ["layers.0.q_proj.weight", "norm.weight"]
    assert pairs == {"layers.0.q_proj": {"A": "layers.0.q_proj.lora_A.weight", "B": "layers.0.q_proj.lora_B.weight"}}
    with pytest.raises(ValueError, match="lora_A but not its pair"):
        split_lora(names[:2])
    assert LORA_RE.match("x.lora_A.default.weight") is None  # peft's live names are not ours


def test_plan_shards_packs_in_order_up_to_the_limit():
    sizes = {"a": 40, "b": 40, "c": 30, "d": 100, "e": 10, "f": 250, "g": 1}
    assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"], ["f"], ["g"]]
    assert plan_shards(sizes, 110) == [["a", "b", "c"], ["d", "e"], ["f"], ["g"]]
    assert plan_shards(sizes, 10**9) == [list(sizes)]
    assert plan_shards({}, 100) == []
    for limit in (1, 50, 100, 300):
        shards = plan_shards(sizes, limit)
        assert [n for s in shards for n in s] == list(sizes)  # every name once, order kept
        assert all(len(s) == 1 or sum(sizes[n] for n in s) <= limit for s in shards)
