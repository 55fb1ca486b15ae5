"""HF safetensors <-> our sharded model and DCP checkpoints (shardlm.interop.hf), on real gloo ranks.

One spawn of 2 ranks does all the distributed work (three HF folders: an untied Llama with Llama-3.1
RoPE scaling, a tied Qwen2 as save_pretrained writes it, and the same with `lm_head.weight` stored
too); the rest (export, import, errors, LoRA) runs in the test process without a process group.

How "each rank reads only its own slices" is measured, on each rank, during `load_hf_weights` only:
  * bytes read from the files: `shardlm.interop.hf.load.safe_open` is wrapped so every tensor materialised from a file
    (`get_slice(...)[...]` or `get_tensor`) is counted. safetensors memory-maps the file and hands out
    views, so this is what is actually paged in and copied.
  * bytes allocated: a TorchDispatchMode records the largest floating-point tensor produced by any
    op that allocates (ops whose schema's outputs alias no input, so views of the mmap or of our own
    shards do not count). A gather, broadcast receive buffer, clone or full-size conversion would show
    up; the test checks the mode does see an all-gather (`full_tensor`) so the bound is not vacuous.
Both must stay below 0.6x the largest full parameter (a rank holds half of each one).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers.hf_tiny import tiny_hf_model
from helpers.launch import run_ranks
from helpers.whole import whole

# transformers is imported lazily (`_tf()`): the spawned ranks import this module and need only torch.

TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    vocab_size=384, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1,
)
CASES = {
    "llama": ("llama", dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                 high_freq_factor=4.0, original_max_position_embeddings=16,
                                                 rope_theta=500000.0))),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    # q/k RMSNorm and a head_dim that is not hidden / heads
    "qwen3": ("qwen3", dict(head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
}
TOKENS = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
SHARD = "50KB"


def _tf():
    return pytest.importorskip("transformers")


def _hf_model(name: str):
    _tf()  # skip without transformers
    model_type, extra = CASES[name]
    return tiny_hf_model(model_type, **TINY, **extra)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _add_tensor(hf_dir: Path, name: str, t: torch.Tensor, file: str = "model-extra.safetensors") -> None:
    """Store one more tensor in its own file and list it in the index."""
    from safetensors.torch import save_file

    save_file({name: t.contiguous()}, str(hf_dir / file), metadata={"format": "pt"})
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = file
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))


def _rewrite(hf_dir: Path, name: str, new: torch.Tensor | None) -> None:
    """Replace (or, with None, drop) tensor `name` in whichever file holds it, keeping the index in step."""
    from safetensors.torch import load_file, save_file

    index_path = hf_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = hf_dir / index["weight_map"][name]
    tensors = load_file(str(file))
    if new is None:
        del tensors[name], index["weight_map"][name]
    else:
        tensors[name] = new
    save_file(tensors, str(file), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


# -- the distributed part: runs on every rank ---------------------------------------------------------
def _measuring_tools():
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Reads:
        def __init__(self):
            self.max_bytes = self.total_bytes = 0

        def note(self, t):
            b = t.numel() * t.element_size()
            self.max_bytes, self.total_bytes = max(self.max_bytes, b), self.total_bytes + b
            return t

    class Slice:
        def __init__(self, inner, reads):
            self.inner, self.reads = inner, reads

        def __getitem__(self, idx):
            return self.reads.note(self.inner[idx])

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class File:
        def __init__(self, reads, *args, **kwargs):
            self.reads, self.ctx = reads, safe_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.ctx.__enter__()
            return self

        def __exit__(self, *exc):
            return self.ctx.__exit__(*exc)

        def get_slice(self, name):
            return Slice(self.inner.get_slice(name), self.reads)

        def get_tensor(self, name):
            return self.reads.note(self.inner.get_tensor(name))

        def keys(self):
            return self.inner.keys()

        def metadata(self):
            return self.inner.metadata()

    class Allocs(TorchDispatchMode):
        """Largest floating-point tensor any allocating (non-aliasing) op produced."""

        max_bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if all(r.alias_info is None for r in func._schema.returns):
                for t in tree_leaves(out):
                    if isinstance(t, DTensor):
                        t = t._local_tensor
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta:
                        self.max_bytes = max(self.max_bytes, t.numel() * t.element_size())
            return out

    return Reads, File, Allocs


def _ranks_load_and_save(cases: dict) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from shardlm.distributed.env import init_distributed
    from shardlm.interop.hf import load as hf_load
    from shardlm.interop.hf.config import read_hf_config
    from shardlm.models.llama import Transformer
    from shardlm.parallel.fsdp import apply_fsdp, mp_policy, shard_view

    env = init_distributed("cpu")
    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("dp_shard",))
    Reads, File, Allocs = _measuring_tools()
    real_open = hf_load.safe_open
    out = {}
    for name, case in cases.items():
        cfg, _ = read_hf_config(case["hf_dir"])
        with torch.device("meta"):
            model = Transformer(cfg)
        apply_fsdp(model, mesh, mp_policy("fp32", "fp32"))
        model.to_empty(device="cpu")
        reads = Reads()
        hf_load.safe_open = lambda *a, **k: File(reads, *a, **k)
        try:
            with Allocs() as allocs:
                skipped = hf_load.load_hf_weights(model, case["hf_dir"])
        finally:
            hf_load.safe_open = real_open
        # Each rank's shard is exactly its rows of the HF tensor (read whole here, after the measurement).
        full = {}
        for f in Path(case["hf_dir"]).glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as fh:
                full.update({k: fh.get_tensor(k) for k in fh.keys()})
        bad, local_bytes, strict_subset = [], 0, True
        for pname, p in model.named_parameters():
            local, row0 = shard_view(p)
            ref = full["lm_head.weight" if pname == "lm_head.weight" else "model." + pname]
            if not torch.equal(local, ref[row0 : row0 + local.shape[0]]):
                bad.append(pname)
            local_bytes += local.numel() * local.element_size()
            strict_subset &= local.shape[0] < p.shape[0]
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        # The allocation tracker is not blind: an all-gather of the biggest parameter registers in full.
        biggest = max(model.parameters(), key=lambda p: p.numel())
        with Allocs() as probe:
            whole(biggest)
        with torch.no_grad():
            logits = model(TOKENS)
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=case["ckpt"])
        imported_diff = None
        if case.get("imported"):  # import_hf_to_dcp's output loads, resharded, into a sharded model
            with torch.device("meta"):
                again = Transformer(cfg)
            apply_fsdp(again, mesh, mp_policy("fp32", "fp32"))
            again.to_empty(device="cpu")
            sd = get_model_state_dict(again)
            dcp.load({"model": sd}, checkpoint_id=case["imported"])
            set_model_state_dict(again, sd)
            again.rope.reset_parameters()
            with torch.no_grad():
                imported_diff = (again(TOKENS) - logits).abs().max().item()
        dist.barrier()
        if env.rank == 0 and case["write_model_config"]:  # what the trainer leaves next to its checkpoints
            import dataclasses

            (Path(case["ckpt"]) / "model_config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        stats = dict(bad=bad, skipped=skipped, reads_max=reads.max_bytes, reads_total=reads.total_bytes,
                     alloc_max=allocs.max_bytes, probe=probe.max_bytes, local_bytes=local_bytes,
                     strict_subset=strict_subset, largest=largest, total=total)
        per_rank = [None] * env.world_size
        dist.all_gather_object(per_rank, stats)
        out[name] = {"ranks": per_rank, "logits": logits, "cfg": cfg, "imported_diff": imported_diff}
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_io")
    refs, cases = {}, {}
    for name in CASES:
        hf = _hf_model(name)
        hf.save_pretrained(tmp / name, max_shard_size=SHARD)
        refs[name] = {"logits": _logits(hf), "sd": {k: v.clone() for k, v in hf.state_dict().items()}}
        cases[name] = {"hf_dir": str(tmp / name), "ckpt": str(tmp / f"ckpt_{name}"),
                       "write_model_config": name == "llama"}
    # A tied model whose files also hold lm_head.weight (older exports do): it must be ignored.
    shutil.copytree(tmp / "qwen2_tied", tmp / "qwen2_tied_head")
    _add_tensor(tmp / "qwen2_tied_head", "lm_head.weight", refs["qwen2_tied"]["sd"]["model.embed_tokens.weight"])
    refs["qwen2_tied_head"] = refs["qwen2_tied"]
    cases["qwen2_tied_head"] = {"hf_dir": str(tmp / "qwen2_tied_head"), "ckpt": str(tmp / "ckpt_qwen2_tied_head"),
                                "write_model_config": False}
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    cases["llama"]["imported"] = str(tmp / "imported" / "step-0")
    import_hf_to_dcp(cases["llama"]["hf_dir"], cases["llama"]["imported"])
    results = run_ranks(2, _ranks_load_and_save, cases)
    return {"tmp": tmp, "refs": refs, "cases": cases, "results": results}


@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "qwen2_tied_head", "qwen3"])
def test_sharded_load_matches_hf(world, name):
    hf_dir = Path(world["cases"][name]["hf_dir"])
    assert len(list(hf_dir.glob("*.safetensors"))) >= 5  # really sharded across files
    res = world["results"][name]
    diff = (res["logits"] - world["refs"][name]["logits"]).abs().max().item()
    assert diff <= 1e-5, f"{name}: max |logit diff| {diff:.3g}"
    for r, st in enumerate(res["ranks"]):
        assert st["bad"] == [], (r, st["bad"])  # local shard == its rows of the HF tensor
        assert st["skipped"] == []
        assert st["strict_subset"], r  # every parameter is split: no rank holds a whole one


@pytest.mark.parametrize("name", ["llama", "qwen2_tied"])
def test_each_rank_reads_and_allocates_only_its_shard(world, name):
    for r, st in enumerate(world["results"][name]["ranks"]):
        assert st["probe"] >= st["largest"], st  # the tracker does see a full gather
        assert st["alloc_max"] < 0.6 * st["largest"], (r, st)
        assert st["reads_max"] < 0.6 * st["largest"], (r, st)
        assert st["reads_total"] == st["local_bytes"], (r, st)  # read exactly its own rows, once
        assert st["reads_total"] < 0.6 * st["total"], (r, st)


def _export_and_reload(world, name, out, **kw):
    from shardlm.interop.hf.export import export_hf

    info = export_hf(world["cases"][name]["ckpt"], out, **kw)
    return info, _tf().AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()


def test_export_round_trip(world, tmp_path):
    # llama: ModelConfig from the checkpoint's model_config.json; small shards -> several files + index.
    info, back = _export_and_reload(world, "llama", tmp_path / "llama", dtype="fp32", max_shard_bytes=60_000)
    assert len(info["files"]) > 2 and (tmp_path / "llama" / "model.safetensors.index.json").is_file()
    assert (_logits(back) - world["refs"]["llama"]["logits"]).abs().max().item() <= 1e-5
    # tied qwen2: ModelConfig passed in; one file, no lm_head written, tokenizer files copied.
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    cfg = world["results"]["qwen2_tied"]["cfg"]
    info, back = _export_and_reload(world, "qwen2_tied", tmp_path / "qwen", model_cfg=cfg, dtype="fp32",
                                    tokenizer_dir=tok)
    assert info["files"] == ["model.safetensors"] and "lm_head.weight" not in info["weight_map"]
    assert back.config.tie_word_embeddings and (tmp_path / "qwen" / "tokenizer.json").is_file()
    assert not (tmp_path / "qwen" / "special_tokens_map.json").exists()
    assert (_logits(back) - world["refs"]["qwen2_tied"]["logits"]).abs().max().item() <= 1e-5
    # qwen3 (q/k norms, explicit head_dim)
    info, back = _export_and_reload(world, "qwen3", tmp_path / "qwen3", model_cfg=world["results"]["qwen3"]["cfg"],
                                    dtype="fp32")
    assert back.config.head_dim == 32
    assert (_logits(back) - world["refs"]["qwen3"]["logits"]).abs().max().item() <= 1e-5
    # bf16 export: the weights are the originals rounded to bf16.
    from shardlm.interop.hf.export import export_hf

    export_hf(world["cases"]["llama"]["ckpt"], tmp_path / "bf16", dtype="bf16")
    got = _hf_tensors(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for k, v in world["refs"]["llama"]["sd"].items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k


def test_imported_checkpoint_loads_sharded(world):
    assert world["results"]["llama"]["imported_diff"] == 0.0


def test_import_then_export_is_exact(world, tmp_path):
    from shardlm.checkpoint import read_keys
    from shardlm.checkpoint.meta import CheckpointMeta
    from shardlm.interop.hf.export import export_hf
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    for name in ("llama", "qwen2_tied_head"):
        ck = tmp_path / name / "step-0"
        cfg = import_hf_to_dcp(world["cases"][name]["hf_dir"], ck)
        assert cfg == world["results"][name]["cfg"] == CheckpointMeta.load(ck).model
        keys = read_keys(ck)
        assert all(k.startswith("model.") for k in keys)
        assert ("model.lm_head.weight" in keys) == (not cfg.tie_embeddings)
        export_hf(ck, tmp_path / name / "hf", dtype="fp32")
        got, want = _hf_tensors(tmp_path / name / "hf"), world["refs"][name]["sd"]
        want = {k: v for k, v in want.items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def _plain_model(hf_dir):
    from shardlm.interop.hf.config import read_hf_config
    from shardlm.models.llama import Transformer

    cfg, _ = read_hf_config(hf_dir)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    return model


def test_bad_hf_folders_are_config_errors(world, tmp_path):
    from shardlm.errors import ConfigError
    from shardlm.interop.hf.config import read_hf_config
    from shardlm.interop.hf.import_ import import_hf_to_dcp
    from shardlm.interop.hf.load import load_hf_weights

    src = Path(world["cases"]["llama"]["hf_dir"])
    model = _plain_model(src)

    def broken(tag, edit):
        d = tmp_path / tag
        shutil.copytree(src, d)
        edit(d)
        return d

    cases = [
        (broken("shape", lambda d: _rewrite(d, "model.layers.1.mlp.up_proj.weight", torch.zeros(3, 3))),
         r"model\.layers\.1\.mlp\.up_proj\.weight.*shape \(3, 3\)"),
        (broken("missing", lambda d: _rewrite(d, "model.norm.weight", None)), r"missing.*model\.norm\.weight"),
        (broken("extra", lambda d: _add_tensor(d, "model.layers.0.self_attn.o_proj.bias", torch.zeros(64))),
         r"unexpected.*o_proj\.bias"),
        (broken("no_head", lambda d: _rewrite(d, "lm_head.weight", None)), r"missing.*lm_head\.weight"),
    ]
    for d, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            load_hf_weights(model, d)
        with pytest.raises(ConfigError, match=pattern):
            import_hf_to_dcp(d, tmp_path / f"ck_{d.name}")
    d = broken("lost_file", lambda d: sorted(d.glob("model-0*.safetensors"))[1].unlink())
    with pytest.raises(ConfigError, match=r"model-00002-of-\d+\.safetensors does not exist"):
        load_hf_weights(model, d)
    with pytest.raises(ConfigError, match="does not exist"):
        read_hf_config(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        read_hf_config(tmp_path / "empty")
    d = broken("gpt2", lambda d: (d / "config.json").write_text(json.dumps({"model_type": "gpt2"})))
    with pytest.raises(ConfigError, match=r"config\.json: .*model_type 'gpt2' is not supported"):
        read_hf_config(d)
    # Same shapes, another RoPE base: refused unless asked for; a model still on meta: refused.
    import dataclasses

    from shardlm.models.llama import Transformer

    with torch.device("meta"):
        other = Transformer(dataclasses.replace(model.cfg, rope_theta=1234.0))
    with pytest.raises(RuntimeError, match="to_empty"):
        load_hf_weights(other, src)
    other.to_empty(device="cpu")
    with pytest.raises(ConfigError, match=r"rope_theta 1234\.0 vs 500000\.0.*check_config=False"):
        load_hf_weights(other, src)
    load_hf_weights(other, src, check_config=False)
    assert torch.equal(other.norm.weight, world["refs"]["llama"]["sd"]["model.norm.weight"])


def test_tied_folder_with_only_the_head(world, tmp_path):
    """A tied model stored as lm_head.weight alone (no embed_tokens): the head feeds the embedding."""
    from shardlm.interop.hf.load import load_hf_weights

    d = tmp_path / "head_only"
    shutil.copytree(world["cases"]["qwen2_tied_head"]["hf_dir"], d)
    _rewrite(d, "model.embed_tokens.weight", None)
    model = _plain_model(d)
    load_hf_weights(model, d)
    assert torch.equal(model.embed_tokens.weight, world["refs"]["qwen2_tied"]["sd"]["model.embed_tokens.weight"])
    with torch.no_grad():
        assert (model(TOKENS) - world["refs"]["qwen2_tied"]["logits"]).abs().max().item() <= 1e-5


def test_export_errors(world, tmp_path):
    from shardlm.errors import CheckpointError, ConfigError
    from shardlm.interop.hf.export import export_hf

    with pytest.raises(CheckpointError, match="no model_config.json"):
        export_hf(world["cases"]["qwen2_tied"]["ckpt"], tmp_path / "x")
    with pytest.raises(CheckpointError, match=r"not a complete checkpoint \(no \.metadata: "
                                                   r"not a checkpoint, or a save that did not finish\)"):
        export_hf(tmp_path, tmp_path / "x")
    wrong = world["results"]["qwen2_tied"]["cfg"]  # a config that does not fit the llama checkpoint
    with pytest.raises(ConfigError, match=r"missing tensor\(s\) layers\.0\.self_attn\.q_proj\.bias"):
        export_hf(world["cases"]["llama"]["ckpt"], tmp_path / "x", model_cfg=wrong)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' own deprecation notes while peft loads
def test_lora_merge_and_peft_adapter(world, tmp_path):
    import torch.distributed.checkpoint as dcp

    from shardlm.errors import CheckpointError, ConfigError
    from shardlm.interop.hf.export import export_hf, export_peft_adapter
    from shardlm.interop.hf.load import load_hf_weights
    from shardlm.lora import apply_lora

    hf_dir = world["cases"]["llama"]["hf_dir"]
    model = _plain_model(hf_dir)
    load_hf_weights(model, hf_dir)
    targets = ["q_proj", "v_proj", "down_proj"]
    apply_lora(model, rank=4, alpha=8.0, targets=targets)
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.05)
        want = model(TOKENS)
    ck = tmp_path / "step-1"
    with warnings.catch_warnings():  # dcp's "assuming ... a single process" note
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(ck), no_dist=True)
    cfg = world["results"]["llama"]["cfg"]
    with pytest.raises(ConfigError, match="--merge-lora.*--adapter-only"):
        export_hf(ck, tmp_path / "x", model_cfg=cfg)
    with pytest.raises(CheckpointError, match="lora_config.json"):
        export_hf(ck, tmp_path / "x", model_cfg=cfg, merge_lora=True)
    (ck / "lora_config.json").write_text(json.dumps({"rank": 4, "alpha": 8.0, "targets": targets}))
    export_hf(ck, tmp_path / "merged", model_cfg=cfg, dtype="fp32", merge_lora=True)
    transformers = _tf()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    assert (_logits(merged.eval()) - want).abs().max().item() <= 1e-4
    assert (want - world["refs"]["llama"]["logits"]).abs().max().item() > 1e-3  # the adapter matters

    adapter = tmp_path / "adapter"
    acfg = export_peft_adapter(ck, adapter)
    assert acfg["peft_type"] == "LORA" and acfg["task_type"] == "CAUSAL_LM" and acfg["r"] == 4
    assert acfg["lora_alpha"] == 8.0 and sorted(acfg["target_modules"]) == sorted(targets) and acfg["bias"] == "none"
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 2 * 3 * 2
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    with_adapter = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    assert (_logits(with_adapter) - want).abs().max().item() <= 1e-5


def test_export_holds_one_shard_and_one_read_at_a_time(world, tmp_path):
    """Export memory is bounded by construction: every checkpoint read is one batch (here: one
    tensor), each yield of iter_hf_tensors holds only what that read completed, and every output file
    is one planned shard; none of them is ever the whole model."""
    from safetensors import safe_open

    from shardlm.checkpoint.reader import CheckpointReader
    from shardlm.interop.hf.export import export_hf, iter_hf_tensors, plan_shards
    from shardlm.interop.hf.names import expected_shapes, natural_key

    sd = world["refs"]["llama"]["sd"]
    total = sum(v.numel() * v.element_size() for v in sd.values())
    largest = max(v.numel() * v.element_size() for v in sd.values())
    reader = CheckpointReader(world["cases"]["llama"]["ckpt"])
    expected = expected_shapes(world["results"]["llama"]["cfg"])
    sizes = {n: reader.tensors[n].nbytes for n in sorted(expected, key=natural_key)}
    shards = plan_shards(sizes, 60_000)
    yields = []
    for shard in shards:
        got = {}
        for batch in iter_hf_tensors(reader, shard, {}, 0.0, torch.float32, batch_bytes=1):  # one tensor per read
            assert len(batch) == 1, sorted(batch)
            yields.append(sum(t.numel() * t.element_size() for t in batch.values()))
            got.update(batch)
        assert sorted(got) == sorted("model." + n if n != "lm_head.weight" else n for n in shard)
        assert all(torch.equal(t, sd[k]) for k, t in got.items())
    assert len(shards) > 2 and sum(yields) == total
    assert max(yields) == largest and max(yields) < total / 4
    # The real export writes exactly those shards, each at most max(60_000, largest) bytes of tensors.
    info = export_hf(world["cases"]["llama"]["ckpt"], tmp_path / "out", dtype="fp32", max_shard_bytes=60_000)
    written = []
    for f in info["files"]:
        with safe_open(str(tmp_path / "out" / f), framework="pt") as fh:
            written.append(sum(fh.get_tensor(k).numel() * 4 for k in fh.keys()))  # noqa: SIM118
    assert len(written) == len(shards) and sum(written) == total == info["total_size"]
    assert all(s <= max(60_000, largest) for s in written)
