"""Every shipped recipe (configs/*.toml) fits the hardware it names in its `# cluster:` header.

The header is one comment line, either `# cluster: nodes=N gpus-per-node=G gpu-mem-gib=M` (planned
on that cluster, as `shardlm plan` would, and must FIT) or `# cluster: cpu` (a laptop recipe: the
planner plans GPU memory only, so these must load and plan, with no verdict). The HF folders the GPU
recipes name are absent here: their `model.preset` gives the planner the shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardlm.config import load_config
from shardlm.plan import GIB, plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(CONFIGS.glob("*.toml"))
HEADER = re.compile(r"^# cluster: (?:(cpu)|nodes=(\d+) gpus-per-node=(\d+) gpu-mem-gib=(\d+(?:\.\d+)?))$")
MARGIN = 0.15  # of usable memory left free: the planner is checked against real runs to within 15%
CPU_RANKS = 2  # the CPU recipes' torchrun lines use 2 gloo ranks


@dataclass(frozen=True)
class Cluster:
    """What a recipe's `# cluster:` header says it runs on (nodes=0 for a CPU recipe)."""

    nodes: int = 0
    gpus_per_node: int = 0
    gpu_mem_gib: float = 0.0

    @property
    def cpu(self) -> bool:
        return self.nodes == 0


def cluster_of(path: Path) -> Cluster:
    """The `# cluster:` line among the file's leading comments; AssertionError if missing or malformed."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# cluster:"):
            m = HEADER.match(line.strip())
            assert m, f"{path.name}: malformed header {line!r}; want e.g. {HEADER.pattern!r}"
            return Cluster() if m.group(1) else Cluster(int(m.group(2)), int(m.group(3)), float(m.group(4)))
    raise AssertionError(f"{path.name}: no '# cluster: ...' line in the leading comments")


def _cpu(path: Path) -> bool:
    """For collection, which never raises: a file without a valid header fails in the GPU test."""
    return "# cluster: cpu" in path.read_text().splitlines()


def test_every_recipe_has_a_cluster_header():
    assert RECIPES, f"no recipes in {CONFIGS}"
    for path in RECIPES:
        cluster_of(path)


@pytest.mark.slow  # ~15-25 s each on 2 cores: the planner runs a fake step of the full-size model
@pytest.mark.parametrize("path", [p for p in RECIPES if not _cpu(p)], ids=lambda p: p.stem)
def test_gpu_recipe_fits_its_cluster(path: Path):
    c = cluster_of(path)
    r = plan(load_config(str(path), []), c.nodes * c.gpus_per_node, c.gpu_mem_gib, c.gpus_per_node,
             alternatives=False)
    assert r.fits, r.format()
    assert r.base.peak_bytes <= (1 - MARGIN) * r.base.usable_bytes, \
        f"{path.name} fits by less than {MARGIN:.0%} of usable memory:\n{r.format()}"


@pytest.fixture(scope="module")
def debug_hf_dir(tmp_path_factory) -> Path:
    """The model `shardlm make-debug-hf` writes for configs/debug_lora.toml (its SFT data is not needed)."""
    pytest.importorskip("transformers")
    from shardlm.assets.debug_hf import make_tiny_hf

    return make_tiny_hf(tmp_path_factory.mktemp("debug_hf") / "model")


@pytest.mark.parametrize("path", [p for p in RECIPES if _cpu(p)], ids=lambda p: p.stem)
def test_cpu_recipe_plans(path: Path, request):
    """No verdict: the planner plans GPU memory (no host-memory mode), so a CPU recipe only has to plan.

    Planned with fp32, what train.mixed_precision=auto runs on a CPU.
    """
    overrides = ["--train.mixed_precision=fp32"]
    cfg = load_config(str(path), overrides)
    if cfg.model.hf_dir is not None and not (cfg.model.hf_dir / "config.json").is_file():
        overrides.append(f"--model.init_from=hf:{request.getfixturevalue('debug_hf_dir')}")
        cfg = load_config(str(path), overrides)
    r = plan(cfg, CPU_RANKS, gpu_mem_gib=80, gpus_per_node=CPU_RANKS, alternatives=False)
    assert 0 < r.base.peak.total < GIB, r.format()  # a tiny model: its tensors well under a GiB per rank
