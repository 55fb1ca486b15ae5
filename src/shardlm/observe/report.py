"""What a run says, and where: one home for the trainer's words.

Lines go out on rank 0 (through the progress bar once there is one). The startup line sums up the run in
one line (ranks, mesh, model, precision, data, batch, kernels); `step(record)` sends one record to
metrics.jsonl, TensorBoard and W&B alike; a mixture's shares and a persistent straggler get lines of their
own; the final line says what ran and where the outputs are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from shardlm._torch_compat import float8_linear_class
from shardlm.config import Config, EvalSection
from shardlm.data import MixtureLoader
from shardlm.distributed.preflight import StepTimes
from shardlm.models.moe import PROJECTIONS, Experts
from shardlm.observe.metrics import MetricsLogger
from shardlm.observe.wandb_log import WandbLogger


class Report:
    """The run's lines and records. Before `open` (the metrics logger exists only once the run's files are
    known) a line is printed on rank 0."""

    def __init__(self, rank0: bool):
        self.rank0 = rank0
        self.metrics: MetricsLogger | None = None
        self.wandb: WandbLogger | None = None
        self._exhausted: list[str] = []

    def open(self, metrics: MetricsLogger, wandb: WandbLogger | None) -> None:
        self.metrics, self.wandb = metrics, wandb

    def line(self, text: str) -> None:
        """A line on rank 0 (through the progress bar once there is one)."""
        if self.metrics is not None:
            self.metrics.write(text)
        elif self.rank0:
            print(text, flush=True)

    def validation_sets(self, e: EvalSection, stores: list) -> None:
        """`data: validation store PATH: N documents, M tokens; evaluated every K steps and at the end`."""
        when = (f"every {e.interval} steps" if e.interval else "") + (" and " if e.interval and e.at_end else "") \
            + ("at the end" if e.at_end else "")
        for store in stores:
            self.line(f"data: validation store {store.path}: {store.documents:,} documents, {store.n_tokens:,} "
                      f"tokens; evaluated {when}")

    def step(self, record: dict[str, Any], step: int) -> None:
        """One record to metrics.jsonl (and TensorBoard) and to W&B."""
        assert self.metrics is not None
        self.metrics.log(record)
        if self.wandb is not None:
            self.wandb.log(record, step)

    def mixture(self, loader: Any, final: bool) -> None:
        """A mixture's realised shares: when a source runs out (epochs cap) and at the last step."""
        if not isinstance(loader, MixtureLoader):
            return
        gone = loader.order.exhausted()
        if final or gone != self._exhausted:
            self._exhausted = gone
            self.line(loader.order.describe())

    def stragglers(self, step_times: StepTimes, times: list[float] | None) -> dict[str, float | None]:
        """step_time_max_rank / step_time_spread of this log interval (None before any step was timed), and
        a persistent straggler named in a line."""
        if not times or not any(times):
            return {"step_time_max_rank": None, "step_time_spread": None}
        out = step_times.record(times)
        if line := step_times.straggler_line():
            self.line(line)
        return out

    def final(self, records: list[dict], started_at: int, step: int, steps: int, elapsed: float, skipped: int,
              best_val: tuple[float, int] | None, output_dir: Path) -> None:
        """`done: ran N steps (...) in Ts, loss a -> b, best val_loss ...; outputs in DIR/`."""
        if not records:
            return
        skip = f" ({skipped} non-finite steps skipped)" if skipped else ""
        ran = step - started_at
        span = f"steps {started_at + 1}-{step}" if ran > 1 else f"step {step}"
        best = f", best val_loss {best_val[0]:.4f} at step {best_val[1]}" if best_val else ""
        self.line(f"done: ran {ran} step{'s' if ran != 1 else ''} ({span}; {step} of train.steps={steps}) in "
                  f"{elapsed:.1f}s{skip}, loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}{best}; outputs in "
                  f"{output_dir}/ (config.toml, metrics.jsonl)")

    def finish(self) -> None:
        """The run ended well: finish W&B and close the metrics files."""
        if self.wandb is not None:
            self.wandb.finish()
        if self.metrics is not None:
            self.metrics.close()

    def abort(self) -> None:
        """The run is released: a W&B run not finished by now crashed (a no-op after `finish`)."""
        if self.wandb is not None:
            self.wandb.finish(exit_code=1)


def mesh_note(mesh: Any, reason: str) -> str:
    """`dp_shard=4`, `dp_replicate=2 x dp_shard=4 (auto: ...)`."""
    note = " x ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names, mesh.shape))
    return note + (f" ({reason})" if reason else "")


def data_note(cfg: Config, stores: list, from_store: bool, attention_note: str) -> str:
    """`3 files`, `store NAME`, `mixture of 2 sources`; `, document masks (sdpa-mask: ...)` when on."""
    if len(stores) > 1:
        note = f"mixture of {len(stores)} sources"
    elif from_store:
        note = f"store {stores[0].path}"
    else:
        n = len(stores[0].manifest["sources"])
        note = f"{n} file{'s' if n != 1 else ''} (prepared: {stores[0].path})"
    return note + (f", document masks ({attention_note})" if cfg.data.document_mask else "")


def precision_note(cfg: Config, device_type: str, model: nn.Module, fp8_all_gather: bool) -> str:
    """``bf16``, or ``fp8 tensorwise (28 float8 linears, float8 all-gather)`` and the like."""
    t = cfg.train
    if t.mixed_precision == "auto":
        return f"{t.precision(device_type)} (train.mixed_precision=auto on {device_type})"
    if t.mixed_precision != "fp8":
        return t.mixed_precision
    float8 = float8_linear_class()
    n = sum(isinstance(m, float8) for m in model.modules()) if float8 else 0
    extra = ", float8 all-gather, scales precomputed after each step" if fp8_all_gather else ""
    return f"fp8 {t.fp8_recipe}{' emulated' if t.fp8_emulate else ''} ({n} float8 linears{extra})"


def fastpath_note(sdpa_backends: list[str] | None, sdpa_note: str, model: nn.Module, optimizer: Any) -> str:
    """The kernels and FSDP schedule chosen: SDPA order, unsharded blocks, prefetch, optimizer kernel."""
    attn = ">".join(sdpa_backends) if sdpa_backends else "torch's default"
    fsdp = getattr(model, "fsdp_choices", None)
    fused = " fused" if getattr(optimizer, "defaults", {}).get("fused") else ""
    return (f"attention {attn} ({sdpa_note}), fsdp {fsdp.note() if fsdp else '?'}, "
            f"optimizer {type(optimizer).__name__}{fused}")


def trainable_note(cfg: Config, model: nn.Module, params: list, base_dtype: str) -> str:
    """`` (3.1% trainable: LoRA r=8)`` when not every parameter trains."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in params)
    if trainable == total:
        return ""
    lora = f": LoRA r={cfg.lora.rank}, base {base_dtype}" if cfg.lora.rank else ""
    experts = next((m for m in model.modules() if isinstance(m, Experts)), None)
    plain = [p for p in PROJECTIONS if experts is not None and p not in experts.logical_shapes]
    if base_dtype == "nf4" and plain:  # said, not hidden: QLoRA quantises the adapted weights only
        dtype = str(getattr(experts, plain[0]).dtype).removeprefix("torch.")
        lora += f" (experts' {','.join(plain)}: {dtype}, not in lora.targets so not NF4)"
    return f" ({trainable / 1e6:.3f}M = {100 * trainable / total:.1f}% trainable{lora})"


def experts_note(mc: Any) -> str:
    """` (3.35B active: top-8 of 128 experts in 48 layers)` for a mixture of experts, else ``."""
    if not mc.n_experts:
        return ""
    active = mc.num_params(active=True)
    return (f" ({active / 1e6:.2f}M active: top-{mc.n_experts_per_tok} of {mc.n_experts} experts in "
            f"{mc.n_moe_layers} of {mc.n_layers} layers)")
