"""Where the repository is, for tests that read its files (docs/, configs/, benchmarks/, the Makefile)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/helpers/paths.py -> the repository's root
