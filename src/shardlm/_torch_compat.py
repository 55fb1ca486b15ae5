"""Every private torch access shardlm makes, in one place, each with the torch versions it was checked on.

A torch upgrade means reviewing this file (and running the suite); nothing else in shardlm imports
a private torch name. Checked on torch 2.11 and 2.13 unless noted.
"""

from __future__ import annotations

# FakeStore: the store for the "fake" process group the planner runs on (torch.testing internals;
# torch >= 2.1).
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

__all__ = ["FakeStore"]
