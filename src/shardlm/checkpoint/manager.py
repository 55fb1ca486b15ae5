"""Checkpointer: sharded DCP save/load that never gathers the full model, atomic, async, resumable.

A checkpoint is `<dir>/step-N/`, a DCP directory holding
  model.*    the model's sharded state dict (`get_state_dict`: DTensor shards, one file per rank)
  optim.*    the optimizer's (AdamW moments and step, keyed by parameter name: reshardable)
  trainer.*  step, samples consumed by the data loader, RNG state
  model_config.json  the model's shape (ModelConfig), so the checkpoint can be exported alone
  checkpoint.json    its lineage (parent, ancestors) and run facts (checkpoint/lineage.py)
It is written as `<dir>/.step-N.partial/` and renamed to `step-N` by rank 0 only once DCP has
written the metadata, i.e. after every rank's shards are on disk. Anything named `.step-*` is
therefore incomplete: `resume=auto` ignores it and rank 0 deletes it.

Before loading, the checkpoint's recorded model shape, LoRA setup, tokenizer and data are compared with
the run's: a difference is a ConfigError naming each field (never a fallback, never corruption).
`resume=auto` loads the newest checkpoint of the folder's current lineage and falls back along it
past any that cannot be loaded for reasons of its own (missing or truncated shard, unreadable
metadata, model-only when the run needs optimizer state).
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from shardlm.config import CheckpointSection
from shardlm._torch_compat import set_element
from shardlm.checkpoint import lineage
from shardlm.checkpoint.layout import METADATA, complete_checkpoints, step_of  # noqa: F401  (also imported from here)
from shardlm.checkpoint.lineage import Record, RunFacts
from shardlm.data.tokenizer import TokenizerRef
from shardlm.errors import CheckpointError, ConfigError, DataError
from shardlm.fsutil import swap_in
from shardlm.checkpoint.meta import CHANGEABLE, CheckpointMeta, data_changes, resume_changes
from shardlm.checkpoint.stored import StoredForm, stored_names
from shardlm.disk import disk_cause, disk_error


def read_keys(path: Path) -> set[str]:
    """The flattened state-dict keys a checkpoint holds; a clear error when it isn't a DCP checkpoint."""
    return set(_metadata(path))


def not_a_checkpoint(path: Path) -> CheckpointError | None:
    """Why `path` is no complete checkpoint (it does not exist; it is a folder of checkpoints; it has no
    .metadata: a save that did not finish), naming the checkpoints nearby; None when it is one."""
    path = Path(path)
    if (path / METADATA).is_file():
        return None
    here = path if path.is_dir() else path.parent
    steps = sorted((p for p in here.glob("step-*") if (p / METADATA).is_file()), key=lambda p: step_of(p) or 0) \
        if here.is_dir() else []
    near = f" ({here} holds {', '.join(p.name for p in steps[-3:])})" if steps else ""
    if not path.exists():
        return CheckpointError(f"checkpoint {path} does not exist; pass a step-N directory{near}")
    if path.is_dir() and steps:
        return CheckpointError(f"{path} is a folder of checkpoints, not one; pass a step-N directory{near}")
    return CheckpointError(f"{path} is not a complete checkpoint (no {METADATA}: not a checkpoint, or a save "
                           f"that did not finish); pass a step-N directory that finished saving{near}")


def _metadata(path: Path) -> dict[str, Any]:
    if (err := not_a_checkpoint(path)) is not None:
        raise err
    try:
        return dict(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception as e:  # a truncated or foreign metadata file
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from None


def saved_tensors(path: Path, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{key: (size, dtype)} of the tensors a checkpoint holds under `prefix.` (the prefix left out)."""
    out = {}
    for key, m in _metadata(path).items():
        if key.startswith(prefix + ".") and hasattr(m, "size") and hasattr(m, "properties"):
            out[key[len(prefix) + 1:]] = (m.size, m.properties.dtype)
    return out


def _first_failure(e: BaseException) -> str:
    """One line for a load failure; DCP wraps each rank's error in CheckpointException.failures."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))
        e = e[0] if isinstance(e, tuple) else e  # (exception, traceback summary)
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _tensors(state: Any) -> dict:
    """A state's values now (a Stateful's `state_dict()`): what async_save stages is this step's."""
    return state.state_dict() if hasattr(state, "state_dict") else state


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor values (optimizer hyperparameters) are read with
    `torch.load(weights_only=True)`: plain numbers and containers, never arbitrary pickles."""

    def load_bytes(self, read_item: ReadItem, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def remove_partials(folder: Path, log) -> None:
    """What unfinished saves left in `folder`: `.step-N.partial` is removed; `.step-N.replaced` (a complete
    checkpoint moved aside while a re-save of step N was swapped in) is put back if `step-N` is missing
    (the process died between the two renames), else removed. One line each."""
    if not folder.is_dir():
        return
    for p in sorted(folder.glob(".step-*")):
        final = folder / p.name[1:].removesuffix(".replaced")
        if p.name.endswith(".replaced") and not final.exists():
            p.rename(final)
            log(f"checkpoint: restored {final.name} (a re-save of it died while replacing it)")
            continue
        log(f"checkpoint: removing incomplete {p.name} (a save that did not finish)")
        shutil.rmtree(p, ignore_errors=True)


class Checkpointer:
    """Owns what a checkpoint holds and when one is written.

    `model` and `optimizer` go through `get_state_dict`/`set_state_dict` (sharded, reshardable: a
    plain `optimizer.state_dict()` would silently reset the AdamW moments on load); every entry of
    `states` is a `Stateful` (or a dict of tensors) saved and loaded under its key, e.g. the
    trainer's step, RNG and data position. `forms`: the stored forms (checkpoint/stored.py) the model's
    parameters may be held in (`shardlm.build.STORED_FORMS`).
    """

    def __init__(self, cfg: CheckpointSection, folder: Path, rank: int, model: nn.Module,
                 optimizer: torch.optim.Optimizer, states: dict[str, Any], log=print, trainable_only: bool = False,
                 meta: CheckpointMeta | None = None, facts: RunFacts | None = None, *,
                 forms: Sequence[StoredForm]):
        unknown = [f for f in cfg.allow_changed if f not in CHANGEABLE]
        if unknown:
            raise ConfigError(f"checkpoint.allow_changed: unknown field(s) {', '.join(unknown)}; valid: "
                              f"{', '.join(CHANGEABLE)}")
        self.cfg, self.folder, self.rank, self.log = cfg, folder, rank, log
        # Run facts written into every checkpoint.json (world size, global batch, schedule, tokenizer, data);
        # the trainer may update them before a save.
        self.facts = facts if facts is not None else RunFacts()
        self.parent: Record | None = None  # the record the next save descends from
        self.resumed_record: Record | None = None
        self.model, self.optimizer, self.states = model, optimizer, states
        # trainable_only (LoRA adapters_only): the frozen base is not saved; it is re-read from its source.
        # Parameters held in a stored form (e.g. a QLoRA base) are saved as its pieces (plain sharded
        # tensors; CheckpointReader reassembles them for the export) but never loaded back: the build refilled
        # them from model.init_from (or the seed), bitwise the same.
        self.forms = tuple(forms)
        self._encoded = stored_names(model, self.forms)
        self.options = StateDictOptions(ignore_frozen_params=trainable_only,
                                        strict=not (trainable_only or self._encoded))
        self._pending: tuple[Future, Path, Path] | None = None
        # The sidecar files (model_config.json, ...) rank 0 writes into every checkpoint before it is
        # published, so that `shardlm convert` can export a checkpoint on its own.
        self.meta = meta
        # Async saves run their collectives from a background thread: give them their own gloo group
        # so they never interleave with the training loop's (and work when the main backend is NCCL).
        self._async_group = dist.new_group(backend="gloo") if cfg.async_ else None
        if rank == 0:
            self.remove_partials()

    # -- finding -----------------------------------------------------------------------------------
    def remove_partials(self) -> None:
        remove_partials(self.folder, self.log)

    def resume_candidates(self) -> list[Path]:
        """What to try loading, best first: the named path, or (auto) the complete ones newest first."""
        r = self.cfg.resume
        if r == "none":
            return []
        if r == "auto":
            return lineage.current_lineage(self.folder)
        p = Path(r)
        if not p.exists():
            raise CheckpointError(f"checkpoint.resume={r!r} does not exist; pass a step-N directory, auto or none")
        read_keys(p)
        return [p]

    # -- loading -----------------------------------------------------------------------------------
    def load(self) -> Path | None:
        """Load the first loadable candidate into the model, optimizer and states (in place); None if none.

        With `auto`, a checkpoint that fails to load for reasons of its own is reported and the next
        older one of the lineage is tried; a config mismatch stops at once (ConfigError). Then rank 0
        sets aside the folder's checkpoints that are not of the resumed lineage (lineage.set_aside).
        """
        candidates = self.resume_candidates()
        loaded, failed = None, []
        for i, path in enumerate(candidates):
            self.check(path)
            try:
                self._load(path)
                loaded = path
                break
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                if isinstance(e, (ConfigError, DataError)):  # this run's setup, not the checkpoint: stop
                    raise
                msg = str(e) if isinstance(e, CheckpointError) else f"{path}: cannot load ({_first_failure(e)})"
                if self.cfg.resume != "auto":
                    raise CheckpointError(msg + "; pass another checkpoint or checkpoint.resume=none") from None
                failed.append(path)
                if i + 1 < len(candidates):
                    self.log(f"checkpoint: {msg}; falling back to {candidates[i + 1].name}")
                else:
                    raise CheckpointError(msg + "; no older complete checkpoint of this lineage to fall back to "
                                          "(checkpoint.resume=none starts fresh, keeping these aside)") from None
        if loaded is not None:
            self.parent = self.resumed_record = Record.read(loaded)
        if self.rank == 0:
            lineage.set_aside(self.folder, loaded, self.log, failed=tuple(failed))
        return loaded

    def check(self, path: Path) -> None:
        """ConfigError when `path` was saved by a different model, LoRA setup or tokenizer than this run's."""
        if self.meta is None:
            return
        try:
            saved = CheckpointMeta.load(path)
        except CheckpointError:
            return  # a malformed sidecar: the load decides (and auto falls back)
        changes = resume_changes(saved, self.meta)
        rec, tok = Record.read(path), self.facts.tokenizer
        old_tok = rec.facts.tokenizer if rec is not None else None
        if old_tok is not None and tok:
            old, new = TokenizerRef.from_record(old_tok), TokenizerRef.from_record(tok)
            if not old.same_as(new):
                changes["tokenizer"] = (old.spec, new.spec)
        if (data := data_changes(rec.facts.data if rec is not None else None, self.facts.data)):
            changes["data"] = data  # another content: the saved data position would mean other samples
        allowed = set(self.cfg.allow_changed)
        bad = {k: v for k, v in changes.items() if k not in allowed}
        if bad:
            fields = "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in bad.items())
            raise ConfigError(f"{path} was saved with a different setup ({fields}); resume with the same "
                              "settings, or start fresh with checkpoint.resume=none (the old checkpoints are kept "
                              "aside) or a new train.output_dir, or allow a deliberate change with "
                              f"--checkpoint.allow_changed={','.join(bad)}")
        for k, (a, b) in changes.items():
            self.log(f"checkpoint: resuming with {k} changed from {a!r} to {b!r} (checkpoint.allow_changed)")

    def _load(self, path: Path) -> None:
        keys = read_keys(path)
        if not all(any(k.startswith(f"{name}.") for k in keys) for name in ("optim", *self.states)):
            raise CheckpointError(f"{path} holds the model only (checkpoint.model_only); training cannot resume "
                                  "from it")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        model_sd = {k: v for k, v in model_sd.items() if k not in self._encoded}
        # A state with `load_template` is loaded at the checkpoint's own shapes, then handed over (it checks them).
        templates = {name: obj.load_template(saved_tensors(path, name)) for name, obj in self.states.items()
                     if hasattr(obj, "load_template")}
        dcp.load({"model": model_sd, "optim": optim_sd, **self.states, **templates}, checkpoint_id=str(path),
                 planner=SafeLoadPlanner())
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=self.options)
        for name, template in templates.items():
            self.states[name].load_state_dict(template)

    # -- saving ------------------------------------------------------------------------------------
    def due(self, step: int, final: bool, stopped: bool) -> bool:
        """Whether step `step` ends with a checkpoint: a stop request, the last step (checkpoint.save_final)
        or a multiple of checkpoint.interval."""
        c = self.cfg
        return stopped or (final and c.save_final) or (c.interval > 0 and step % c.interval == 0)

    def save(self, step: int, final: bool = False, blocking: bool = False) -> None:
        """Write step-N: the model only when `final` and checkpoint.model_only. Async unless `blocking`,
        `final` or not configured."""
        model_only = final and self.cfg.model_only
        blocking = blocking or final
        self.wait()  # one save in flight at a time
        final, tmp = self.folder / f"step-{step}", self.folder / f".step-{step}.partial"
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        if model_only:
            state = {"model": get_model_state_dict(self.model, options=self.options)}
        else:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
            state = {"model": model_sd, "optim": optim_sd, **{k: _tensors(v) for k, v in self.states.items()}}
        if self._encoded:
            for form in self.forms:
                state["model"] = form.to_stored(state["model"], self.model)
        if self.cfg.async_ and not blocking:
            # async_save copies the state to host memory before returning: what lands on disk is
            # this step's state even though training goes on and changes the parameters.
            fut = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_group)
            self._pending = (fut, tmp, final)
            return
        t0 = time.perf_counter()
        try:
            dcp.save(state, checkpoint_id=str(tmp))
            self._publish(tmp, final, time.perf_counter() - t0)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._failed_save(e, tmp, final)
            raise

    def _failed_save(self, exc: BaseException, tmp: Path, final: Path) -> None:
        """A save that failed for a full disk, a quota or a file-size limit: remove its partial folder (what
        filled the disk; rank 0, which every rank's DCP error reaches) and raise one line naming the disk, the
        size of one checkpoint and the checkpoint that stands. Other failures: nothing (the caller re-raises)."""
        cause = disk_cause(exc, self.folder, written=tmp)  # before the partial goes (it shows the limit hit)
        if cause is None and self.rank != 0 and isinstance(exc, CheckpointException) and not tmp.exists():
            import errno  # rank 0 saw the same failed save first, found the disk full and removed the partial

            cause = OSError(errno.ENOSPC, "the disk is full (as rank 0 found)")
        if cause is None:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        stands = lineage.current_lineage(self.folder)
        after = (f"the partial {tmp.name} was removed; the last complete checkpoint {stands[0].name} stands"
                 if stands else f"the partial {tmp.name} was removed; no complete checkpoint stands yet")
        raise disk_error(exc, self.folder, f"checkpoint {final.name}", needed=self.checkpoint_bytes(), after=after,
                         cause=cause) from None

    def checkpoint_bytes(self) -> int | None:
        """Bytes of one full checkpoint (all ranks): the model's and the optimizer's state, as saved."""
        if self.model is None:
            return None
        total = 0
        for p in self.model.parameters():
            if self.options.ignore_frozen_params and not p.requires_grad:
                continue
            total += p.numel() * p.element_size()
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        total += v.numel() * v.element_size()  # a DTensor: its global size
        return total

    def poll(self) -> None:
        """Publish an async save that has finished (cheap; call once per step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is written, then publish it."""
        if self._pending is None:
            return
        fut, tmp, final = self._pending
        self._pending = None
        t0 = time.perf_counter()
        try:
            fut.result()
            self._publish(tmp, final, time.perf_counter() - t0, waited=True)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._failed_save(e, tmp, final)
            raise

    def _publish(self, tmp: Path, final: Path, seconds: float, waited: bool = False) -> None:
        """Rank 0 makes the finished checkpoint visible (atomic rename), then prunes old ones."""
        if self.rank != 0:
            return
        if self.meta is not None:
            self.meta.save(tmp)
        step = int(final.name.split("-", 1)[1])
        record = lineage.new_record(self.folder, step, self.parent, self.facts)
        (tmp / lineage.RECORD_FILE).write_text(record.to_json())
        # Re-saving a step (resumed from an older checkpoint): the old one is swapped out whole, not merged;
        # a death between the two renames leaves it as .step-N.replaced, which remove_partials puts back.
        swap_in(tmp, final, aside=final.with_name(f".{final.name}.replaced"))
        self.parent = record
        how = f"waited {seconds:.2f}s for the async write" if waited else f"{seconds:.2f}s"
        self.log(f"checkpoint: saved {final} ({how})")
        self.prune()

    def prune(self) -> None:
        """Delete all but the newest checkpoint.keep_last of the current lineage; never a branch point."""
        if self.cfg.keep_last <= 0:
            return
        keep = lineage.protected(self.folder)
        for p in lineage.current_lineage(self.folder)[self.cfg.keep_last:]:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        """Finish the in-flight save and let go of the model (its FSDP state holds the process groups)."""
        self.wait()
        self.model = self.optimizer = None
        self.states = {}
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None
