"""Parallelism applied to a plain model from outside: mesh, FSDP2 (later: AC, float8, compile)."""
