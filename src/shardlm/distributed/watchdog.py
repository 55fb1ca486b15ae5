"""A dead or stalled peer ends every surviving rank with one line, never a hang.

Three layers, from the most to the least precise:

1. Process-group timeouts (`set_timeouts`): a collective whose peer never comes raises after the
   timeout (gloo: `RuntimeError: ... Timed out waiting 5000ms for recv operation`), and one whose peer
   process died raises at once (gloo: `... Connection closed by peer`).
2. `Watchdog.guard()` around the training step turns such an exception into the one line
   (`Watchdog.failed`), which names the step, the phase (the last `enter()`) and the rank waited for.
3. The watchdog thread publishes this rank's heartbeat to the c10d store every `heartbeat_s` (so that a
   failing rank can tell which peer is dead or behind) and is the backstop: when no `enter()` came for
   `timeout + grace_s` it fails the rank itself. That ends hangs that no collective reports (a host that
   vanished without closing its sockets, NCCL, where the process group's own watchdog aborts instead of
   raising, or a timeout that a torch build does not apply). Below it, for a main thread stuck in C++
   with the GIL held (the watchdog thread cannot run then), faulthandler's timer (re-armed by the
   thread at every heartbeat) dumps every thread's stack and exits (code 1) after `timeout + 3 grace + 60 s`.

`enter()` is the only thing the hot path calls (per block per step, from the FSDP hooks `attach`
installs): two attribute writes and a clock read. It also restarts the backstop's clock, so code that
waits a long time for a good reason (a large checkpoint write, data preparation) only needs an
`enter("checkpoint save")` before it and must finish within the timeout (+ grace) like a collective.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import re
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from shardlm._torch_compat import dump_flight_recorder, set_pg_timeout
from shardlm.errors import CommError, say

TAIL = "the last complete checkpoint stands (resume with checkpoint.resume=auto)"
# gloo raises plain RuntimeErrors (torch 2.13): "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out
# waiting 5000ms for recv operation to complete", "[.../pair.cc:553] Connection closed by peer [addr]:port",
# and, for the next op on a pair that timed out, "Application timeout caused pair closure".
_GLOO_FAILURE = re.compile(r"gloo/transport|Timed out waiting \d+ms|Connection (closed|reset) by peer|"
                           r"Application timeout caused pair closure|(Read|Write) error")


def set_timeouts(groups: DeviceMesh | Iterable[Any], seconds: float) -> None:
    """After a barrier, every collective on the default group and on `groups` (a DeviceMesh: each of its
    dimensions' groups) times out after `seconds` (torchtitan lowers the init timeout this way after the
    first step). The barrier first: no rank changes a timeout under a collective another rank still runs."""
    if not dist.is_initialized():
        return
    if isinstance(groups, DeviceMesh):
        groups = [groups.get_group(i) for i in range(groups.ndim)]
    dist.barrier()
    seen: set[int] = set()
    for group in [dist.group.WORLD, *groups]:
        if id(group) not in seen:
            seen.add(id(group))
            set_pg_timeout(group, seconds)


def heartbeat_store(timeout_s: float = 5.0) -> dist.Store | None:
    """A client of the rendezvous store (MASTER_ADDR:MASTER_PORT) of its own, for the heartbeats; None
    without one (a plain 1-process run). Its own connection: its short timeout and a read blocked on a
    vanished host never touch the process group's client."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except Exception:
        return None


def is_comm_failure(exc: BaseException) -> bool:
    """A failing collective (a dead or stalled peer, a broken communicator), as opposed to a bug."""
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, dist.DistError):
            return True
        if type(e) is RuntimeError and _GLOO_FAILURE.search(str(e)):
            return True
    return False


def _exit_later(seconds: float) -> None:
    """Dump every thread's stack and end the process in `seconds` unless re-armed or cancelled. It writes to
    the process's real stderr: a replaced sys.stderr (pytest's capture, a notebook's) has no file number."""
    try:
        out = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        out = 2  # the process's own stderr, whatever sys.stderr was replaced by
    faulthandler.dump_traceback_later(seconds, exit=True, file=out)


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat: `beat` counts up while its watchdog thread lives; `progress` counts enter()s."""

    beat: int
    step: int
    progress: int
    wall: float  # time.time() when published (compared across hosts: NTP-level skew is fine here)
    phase: str
    failed: bool = False  # this rank has given up itself (its own line says why): not the one waited for

    def encode(self) -> str:
        return f"{self.beat} {self.step} {self.progress} {self.wall:.3f} {int(self.failed)} {self.phase}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Beat | None:
        text = raw.decode() if isinstance(raw, bytes) else raw
        parts = text.split(" ", 5)
        try:
            return cls(int(parts[0]), int(parts[1]), int(parts[2]), float(parts[3]), parts[5], parts[4] == "1")
        except (IndexError, ValueError):
            return None


Snapshot = dict[int, "Beat | None"]  # rank -> its heartbeat (None: never published)


def step_label(step: int, phase: str) -> str:
    """`step N` of a rank that has done `step` optimizer steps: a checkpoint is saved after its step,
    everything else belongs to the next one."""
    return f"step {step if phase.startswith('checkpoint') else step + 1}"


def _secs(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def _ranks(rs: list[int], most: int = 8) -> str:
    if len(rs) == 1:
        return f"rank {rs[0]}"
    more = f" and {len(rs) - most} more" if len(rs) > most else ""
    return f"ranks {', '.join(map(str, rs[:most]))}{more}"


def _dead_text(dead: list[int], second: Snapshot, now: float, world: int, local_world_size: int) -> str:
    ages = [now - b.wall for r in dead if (b := second.get(r)) is not None]
    since = f"no heartbeat for {max(ages):.0f} s" if ages else "no heartbeat at all"
    nodes = sorted({r // local_world_size for r in dead}) if local_world_size > 1 else []
    whole = [n for n in nodes if all(r in dead for r in range(n * local_world_size,
                                                               min(world, (n + 1) * local_world_size)))]
    if nodes and whole == nodes:  # every rank of these nodes is gone: name the nodes
        which = ", ".join(f"{n} (ranks {n * local_world_size}-{min(world, (n + 1) * local_world_size) - 1})"
                          for n in nodes)
        return f"node{'s' if len(nodes) > 1 else ''} {which} ({since}: host or agent gone, or frozen)"
    return f"{_ranks(dead)} ({since}: process gone or frozen)"


def waited_for(first: Snapshot | None, second: Snapshot | None, me: int, now: float,
               local_world_size: int = 1) -> str:
    """Which rank(s) this one waits for, from two heartbeat snapshots ~2.5 heartbeats apart.

    A rank whose beat counter did not move is dead or frozen (it is the cause, whatever the others
    do); else, among live ranks, those at an earlier (step, progress) than the furthest one are the
    ones the rest wait for. Ranks that have given up themselves are neither. `unknown (...)` when the
    heartbeats do not tell.
    """
    if first is None or second is None:
        return "unknown (the heartbeat store is unreachable)"
    world = max([*first, *second, me]) + 1
    others = [r for r in range(world) if r != me]
    gave_up = {r for r in others if (b := second.get(r)) is not None and b.failed}
    dead = [r for r in others if r not in gave_up
            and (second.get(r) is None or (first.get(r) is not None and first[r].beat == second[r].beat))]
    if dead:
        return _dead_text(dead, second, now, world, local_world_size)
    live = {r: b for r, b in second.items() if b is not None and r not in gave_up}
    if not live or set(live) == {me}:
        return "unknown (every other rank has failed too)"
    top = max((b.step, b.progress) for b in live.values())
    behind = sorted((r for r, b in live.items() if r != me and (b.step, b.progress) < top),
                    key=lambda r: (live[r].step, live[r].progress, r))
    if not behind:
        return "unknown (every rank is alive and at the same point)"
    groups: dict[tuple[str, str], list[int]] = {}
    for r in behind:
        groups.setdefault((live[r].phase, step_label(live[r].step, live[r].phase)), []).append(r)
    parts = [f"{_ranks(rs)} (alive, still in '{phase}' at {step})" for (phase, step), rs in list(groups.items())[:3]]
    return "; ".join(parts)


def short_message(exc: BaseException, limit: int = 160) -> str:
    """The exception's first sentence on one line, without gloo's `[file.cc:NN]` prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    text = text.split(". ")[0].rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def launcher_of(environ: Mapping[str, str] | None = None) -> int | None:
    """The pid of the elastic agent that started this process (its parent, when TORCHELASTIC_RUN_ID says
    one did; torchrun and `shardlm train --nproc-per-node` both set it), else None."""
    environ = os.environ if environ is None else environ
    return os.getppid() if "TORCHELASTIC_RUN_ID" in environ else None


def exit_with(line: str) -> NoReturn:
    """The default `on_failure`: the line on stderr (every rank: rank 0 may be the one that died) and in
    torchrun's error file, then `os._exit(8)`. Not `sys.exit`: torchrun SIGTERMs the other workers as
    soon as one exits, destroying a broken gloo group can hang, and NCCL's teardown can too."""
    try:
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not (error_file and os.environ.get("SHARDLM_LAUNCHER")):  # that launcher prints it from the file
            say(line)
        if error_file:
            with open(error_file, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
    finally:
        os._exit(CommError.exit_code)


def install_test_stall(watchdog: "Watchdog", spec: str | None) -> None:
    """A test hook: `SHARDLM_TEST_STALL=rank:step:phase:seconds` makes that rank hang on its way into the first
    phase starting with `phase` in optimizer step `step` (1-based): it sleeps before it gets there, as a
    peer stuck in the work before a collective would, while the others wait in that collective. Call
    before `attach`."""
    if not spec:
        return
    rank, step, phase, seconds = spec.split(":")
    if int(rank) != watchdog.rank:
        return
    enter = watchdog.enter

    def stalling_enter(name: str) -> None:
        if watchdog.step + 1 == int(step) and name.startswith(phase):
            time.sleep(float(seconds))
        enter(name)

    watchdog.enter = stalling_enter  # type: ignore[method-assign]


_LIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()  # started and not stopped, in this process


@atexit.register
def _stop_all() -> None:
    """Stop every watchdog still running (a Trainer never closed). atexit runs before the interpreter
    finalizes: a daemon thread still inside the store's C++ call when it does is killed by forced unwinding
    and aborts the process after a successful run ("terminate called without an active exception")."""
    for wd in list(_LIVE):
        wd.stop()


class Watchdog:
    """Heartbeats, phase tracking and the backstop of one rank (see the module docstring).

    One per process runs at a time: starting one stops those of earlier Trainers in the process (their
    training is over; left running, their backstops would end the process after `timeout + grace`)."""

    def __init__(self, rank: int, world_size: int, store: dist.Store | None, timeout_s: float, *,
                 local_world_size: int = 1, on_failure: Callable[[str], NoReturn] | None = None,
                 heartbeat_s: float = 1.0, grace_s: float = 30.0, dump_dir: Path | None = None,
                 backend: str = "gloo", tail: str | Callable[[], str] = TAIL, launcher_pid: int | None = None):
        self.rank, self.world_size, self.store = rank, world_size, store
        self.local_world_size = max(1, local_world_size)
        self.on_failure = on_failure or exit_with
        self.heartbeat_s, self.grace_s = heartbeat_s, grace_s
        self.dump_dir, self.backend, self.tail = dump_dir, backend, tail
        self.timeout_s = timeout_s
        # the elastic agent (torchrun, `shardlm train --nproc-per-node`) that started this rank: when it is
        # gone this process is an orphan no launcher will restart or stop (see `launcher_of`)
        self.launcher_pid = launcher_pid
        self.step = 0  # optimizer steps done (the trainer sets it); a failure in training is in step + 1
        self.phase = "setup"
        self.progress = 0
        self._since = time.monotonic()
        self._beats = 0
        self._failing = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reported = threading.Event()  # set only when on_failure returned (tests)
        self._thread: threading.Thread | None = None
        # Not per torchrun attempt: after a restart the agents' restart counts differ (a replaced node starts
        # at 0). `start()` publishes at once, so a beat left by an earlier attempt is overwritten before
        # anyone could read it in a failure.
        self._prefix = "shardlm/hb/"

    # -- the hot path ------------------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        """This rank now runs `phase`; also restarts the backstop's clock. Phases named `setup...` (and
        `checkpoint load`) are reported as `during setup`, the rest as `step <self.step + 1>`
        (`checkpoint ...`: `step <self.step>`, the step just saved)."""
        self.phase = phase
        self.progress += 1
        self._since = time.monotonic()

    def set_timeout(self, seconds: float) -> None:
        """The collective timeout the backstop adds `grace_s` to, from now on."""
        self.timeout_s = seconds
        self._since = time.monotonic()

    def pg_timeout_s(self, seconds: float) -> float:
        """The process-group timeout to go with watchdog timeout `seconds`: the same on gloo (its
        collectives raise, `guard` reports them); on NCCL `seconds + 2 grace`, after the backstop
        (`seconds + grace`): on a timeout ProcessGroupNCCL's own watchdog ends the process (SIGABRT under
        the default TORCH_NCCL_ASYNC_ERROR_HANDLING=3) without a Python line, so the backstop speaks first."""
        return seconds + 2 * self.grace_s if self.backend == "nccl" else seconds

    # -- the thread --------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        for other in list(_LIVE):
            other.stop()
        _LIVE.add(self)
        self._publish()
        self._thread = threading.Thread(target=self._run, name="shardlm-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        _LIVE.discard(self)
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.heartbeat_s + 5)
        self._thread = None
        self.store = None  # let its connection close now, not during interpreter shutdown

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if not self._failing:
                _exit_later(self.timeout_s + 3 * self.grace_s + 60)
            self._publish()
            idle = time.monotonic() - self._since
            orphaned = self.launcher_pid is not None and os.getppid() != self.launcher_pid
            if (orphaned or idle > self.timeout_s + self.grace_s) and not self._failing:
                try:
                    self.orphaned() if orphaned else self.failed(None)
                except BaseException:  # a test's on_failure returned: CommError ends the thread
                    return

    def _publish(self) -> None:
        if self.store is None:
            return
        self._beats += 1
        beat = Beat(self._beats, self.step, self.progress, time.time(), self.phase, self._failing)
        try:
            self.store.set(self._prefix + str(self.rank), beat.encode())
        except Exception:  # the store's host is gone (it does not come back): no more beats, the backstop stays
            self.store = None

    def snapshot(self) -> Snapshot | None:
        """Every rank's last heartbeat, or None when the store cannot be read."""
        if self.store is None:
            return None
        beats: Snapshot = {}
        try:
            for r in range(self.world_size):
                key = self._prefix + str(r)
                beats[r] = Beat.decode(self.store.get(key)) if self.store.check([key]) else None
        except Exception:
            return None
        return beats

    def who(self) -> str:
        """`waited_for` over two snapshots 2.5 heartbeats apart (this rank keeps beating meanwhile)."""
        first = self.snapshot()
        deadline = time.monotonic() + 2.5 * self.heartbeat_s
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, self.heartbeat_s))
            if self._thread is None or not self._thread.is_alive() or threading.current_thread() is self._thread:
                self._publish()
        return waited_for(first, self.snapshot(), self.rank, time.time(), self.local_world_size)

    # -- the failure path --------------------------------------------------------------------------
    def line(self, cause: str) -> str:
        """`shardlm: error: rank R: step S: <cause>; <tail>`: the one line of this rank's failure."""
        if self.progress == 0 or self.phase.startswith("setup") or self.phase == "checkpoint load":
            when = "during setup"
        else:
            when = step_label(self.step, self.phase)
        tail = self.tail
        if callable(tail):
            try:
                tail = tail()
            except Exception:  # the folder cannot be read now: say what is always true
                tail = "resume with checkpoint.resume=auto from the last complete checkpoint, if any"
        return f"shardlm: error: rank {self.rank}: {when}: {cause}; {tail}"

    def orphaned(self) -> NoReturn:
        """The launcher that started this rank is gone (killed, its node's agent died): nothing will stop or
        restart this rank with its peers, which wait or are being torn down. One line, then `on_failure`."""
        with self._lock:
            if self._failing:
                raise CommError(self.line("its launcher is gone while this rank was already failing"))
            self._failing = True
        self._publish()
        line = self.line(f"its launcher (pid {self.launcher_pid}, the torchrun agent) is gone, so nothing would "
                         "stop or restart this rank with its peers: stopping it")
        self._stop.set()
        if os.environ.get("SHARDLM_LAUNCHER"):  # that launcher is the one gone: nobody else will print it
            say(line)
        self.on_failure(line)
        self._reported.set()
        raise CommError(line)

    def failed(self, exc: BaseException | None, where: str | None = None) -> NoReturn:
        """Build the line for `exc` (None: the backstop's no-progress) and hand it to `on_failure`; if
        that returns, raise CommError with it. Concurrent calls (the guard and the backstop): the
        first one reports; a later one waits for it to end the process, then raises."""
        with self._lock:
            first, self._failing = not self._failing, True
        if not first:
            self._reported.wait(60)
            raise CommError(self.line("collective failed while this rank was already failing")) from exc
        phase, idle = where or self.phase, time.monotonic() - self._since
        self._publish()  # mark this rank as failed: the others must not wait-for it
        who = self.who() if self.world_size > 1 else "nobody (1 rank)"
        if who.startswith("unknown"):
            who = "an unknown rank" + who[len("unknown"):]
        if exc is None:
            cause = (f"no progress for {_secs(idle)} s in {phase} (timeout {_secs(self.timeout_s)} s + "
                     f"{_secs(self.grace_s)} s grace), waiting for {who}")
        else:
            cause = f"collective failed in {phase} after {idle:.1f} s, waiting for {who}: {short_message(exc)}"
        dump = self.dump()
        if dump is not None:  # before the tail: the line ends with what stands and how to go on
            cause += f"; flight recorder: {dump}"
        line = self.line(cause)
        self._stop.set()  # no more beats; faulthandler's timer ends the process if the report itself hangs
        _exit_later(self.grace_s + 60)
        self.on_failure(line)
        faulthandler.cancel_dump_traceback_later()  # on_failure returned (a test's)
        self._reported.set()
        raise CommError(line) from exc

    def dump(self) -> Path | None:
        """Write the flight recorder to `dump_dir/rank_<r>`, else to `$TORCH_FR_DUMP_TEMP_FILE<r>` (where torch
        itself dumps on an NCCL timeout: the same pickle, the same name); on NCCL, or on any backend with
        TORCH_FR_BUFFER_SIZE set. The path, or None. Never raises."""
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
        if self.dump_dir is not None:
            path = Path(self.dump_dir) / f"rank_{self.rank}"
        elif prefix:
            path = Path(f"{prefix}{self.rank}")
        else:
            return None
        size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "0"
        if self.backend != "nccl" and not (size.isdigit() and int(size) > 0):
            return None
        try:
            blob = dump_flight_recorder(self.backend)
            if blob is None:
                return None
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(blob)
            return path
        except Exception:
            return None

    @contextmanager
    def guard(self, where: str | None = None) -> Iterator[None]:
        """Around code that runs collectives: a failing collective becomes the one line (`failed`);
        anything else (a bug, Ctrl-C) passes through untouched, traceback and all."""
        if where is not None:
            self.enter(where)
        try:
            yield
        except Exception as e:
            if is_comm_failure(e) and not isinstance(e, CommError):  # CommError: reported (nested guards)
                self.failed(e)
            raise

    # -- FSDP hooks --------------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> list[Any]:
        """`enter()` at each FSDP unit's forward (before its all-gather) and at the start of its backward.

        Units: the blocks of `model.layers` ("block i") and the root ("embeddings/head"). Forward: a
        pre-hook placed before FSDP's own (which all-gathers). Backward: a hook on the unit's output,
        registered before FSDP's pre-backward, so it fires first when that output's gradient arrives;
        the collectives that then block are the block's reduce-scatter (and the next all-gather).
        The hooks are hidden from torch.compile (like FSDP's). Returns the hook handles.
        """
        index = {id(b): i for i, b in enumerate(getattr(model, "layers", []))}
        handles = []
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            unit = f"block {index[id(module)]}" if id(module) in index else (name or "embeddings/head")
            handles += self._hook(module, f"forward all-gather ({unit})", f"backward reduce-scatter ({unit})")
        return handles

    def _hook(self, module: nn.Module, forward: str, backward: str) -> list[Any]:
        enter = self.enter

        @torch.compiler.disable
        def pre(_module: nn.Module, _args: Any) -> None:
            enter(forward)

        def on_grad(_grad: torch.Tensor) -> None:
            enter(backward)

        @torch.compiler.disable
        def post(_module: nn.Module, _args: Any, output: Any) -> None:
            if torch.is_grad_enabled() and (t := _first_grad_tensor(output)) is not None:
                t.register_hook(on_grad)

        return [module.register_forward_pre_hook(pre, prepend=True),
                module.register_forward_hook(post, prepend=True)]


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for item in items:
        if (t := _first_grad_tensor(item)) is not None:
            return t
    return None
