"""The optional dependencies (pyproject's extras), imported only by the feature that needs them.

`require(module, extra, what)` imports one and returns it; when it is missing the feature fails
with one line (a `ConfigError`) that names the package and the extra to install:

    `shardlm make-debug-hf` needs transformers (not installed): pip install 'shardlm[hf]'

[hf] transformers, peft · [fp8] torchao · [viz] tensorboard, matplotlib · [data] pyarrow, zstandard ·
[wandb] wandb · [eval] lm-eval. Nothing else in shardlm imports these
at module level, so a command that does not use them never loads them (nor prints their import noise).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from shardlm.errors import ConfigError

# (logger, words in the message) of lines libraries print while being imported that are about themselves,
# not about anything shardlm does: torchao's optional C++ kernels that this machine cannot load, and
# torch's deprecation of the Enum registrations torchao makes at import.
IMPORT_NOISE = (
    ("torchao", "Failed to load "),
    ("torchao", "Skipping import of cpp extensions"),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
)


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import `module` (quietly) and return it, or raise a one-line ConfigError:
    "{what} needs {package} (not installed): pip install 'shardlm[{extra}]'".

    `what` is written as given: the feature asking, e.g. "`shardlm make-debug-hf`" or
    "train.mixed_precision=fp8". `module` may be a submodule ("torchao.float8"); the error names the
    package that is missing (for "torch.utils.tensorboard": tensorboard).
    """
    try:
        with quiet_imports():
            return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = (e.name or module).partition(".")[0]
        if _installed(missing):  # the package is there but lacks `e.name`: too old
            raise ConfigError(f"{what} needs a newer {missing} ({e.name} is missing): "
                              f"pip install -U 'shardlm[{extra}]'") from None
        raise ConfigError(f"{what} needs {missing} (not installed): pip install 'shardlm[{extra}]'") from None
    except Exception as e:  # installed but broken, e.g. built for another torch
        raise ConfigError(f"{what} needs {module}, which is installed but fails to import "
                          f"({type(e).__name__}: {e}): pip install -U 'shardlm[{extra}]'") from e


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


class _Drop(logging.Filter):
    def __init__(self, words: str):
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        return self.words not in record.getMessage()


@contextmanager
def quiet_imports() -> Iterator[None]:
    """Drop the IMPORT_NOISE lines while the block runs (an extra's import, or code that imports one)."""
    filters = [(logging.getLogger(name), _Drop(words)) for name, words in IMPORT_NOISE]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)


__all__ = ["IMPORT_NOISE", "quiet_imports", "require"]
