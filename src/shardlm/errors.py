"""The error types (a leaf module: imports nothing from shardlm). Each maps to one exit code.

The CLI prints a `ShardlmError` as one line (`shardlm: error: ...`) and exits with its `exit_code`;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ShardlmError(Exception):
    """A user-facing failure: one line that names the problem and the fix."""

    exit_code = 1


class ConfigError(ShardlmError):
    """A config key, value, command-line argument or file named in the config is wrong."""

    exit_code = 2


class DataError(ShardlmError):
    """The training data (or its tokenizer) cannot be read or is unusable: empty, malformed, too short."""

    exit_code = 4


class CheckpointError(ShardlmError):
    """A checkpoint is missing, incomplete, unreadable or does not match the run."""

    exit_code = 5


class TrainingError(ShardlmError):
    """Training went wrong at run time: a non-finite loss or gradient norm, too many skipped steps."""

    exit_code = 6


class PlanError(ShardlmError):
    """The planner cannot run here (e.g. inside a process group)."""

    exit_code = 7


class CommError(ShardlmError):
    """A peer rank died or a collective timed out: the line names the step, the collective phase and the
    rank waited for (where known). Raised to the CLI only where the process can still unwind; the
    watchdog (distributed/watchdog.py) prints the same kind of line and ends the process itself."""

    exit_code = 8


class PreflightError(ShardlmError):
    """parallel.preflight=strict found a rank more than 20% slower than the median."""

    exit_code = 9


class StorageError(ShardlmError):
    """A disk is full or over quota, or a file hit the size limit (ENOSPC, EDQUOT, EFBIG): the line names
    the folder, its disk's free space and what was needed (shardlm/disk.py)."""

    exit_code = 10


class Interrupted(ShardlmError):
    """Ctrl-C (SIGINT): `interrupted at step N; last complete checkpoint step-M`, printed as
    `shardlm: <that>` (not as an error)."""

    exit_code = 130


PLAN_DOES_NOT_FIT = 3  # `shardlm plan`'s exit code when the config does not fit (not an error)

EXIT_CODES = {0: "success (`shardlm plan`: the config fits)", 1: "other shardlm error",
              ConfigError.exit_code: "bad config, argument or input file",
              PLAN_DOES_NOT_FIT: "`shardlm plan`: the config does not fit",
              DataError.exit_code: "unusable training data or tokenizer",
              CheckpointError.exit_code: "checkpoint missing, incomplete, unreadable or mismatched",
              TrainingError.exit_code: "non-finite loss/gradients (train.nonfinite) or too many skipped steps",
              PlanError.exit_code: "the planner cannot run here",
              CommError.exit_code: "a peer rank died or a collective timed out (the line names step, phase, rank)",
              PreflightError.exit_code: "parallel.preflight=strict: a rank is more than 20% slower than the median",
              StorageError.exit_code: "a disk is full or over quota, or a file hit the size limit (ulimit -f)",
              Interrupted.exit_code: "interrupted (Ctrl-C)"}


def say(line: str, stream=None) -> None:
    """Write `line` and its newline to `stream` (default: stderr) in one write, then flush. Ranks share a terminal
    or a log file, and with PYTHONUNBUFFERED=1 `print()` writes the text and the newline separately: two ranks'
    lines then splice into one (seen: two ranks' "its launcher is gone" lines on one line of a torchrun log)."""
    import sys

    stream = sys.stderr if stream is None else stream
    stream.write(line + "\n")
    stream.flush()
