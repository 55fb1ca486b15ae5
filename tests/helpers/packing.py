"""Best-fit packing as lists of sample indices: `shardlm.data.sft.pack_rows`'s answer in a form a test can read
and compare with a reference on small inputs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardlm.data.sft import pack_rows


def pack_best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """`pack_rows(lengths, capacity)` as one list of sample indices per row."""
    ptr, items = pack_rows(np.asarray(lengths, dtype=np.int64), capacity)
    return [items[ptr[r]:ptr[r + 1]].tolist() for r in range(len(ptr) - 1)]
