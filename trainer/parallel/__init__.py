"""Parallelism applied to an unmodified model: one mesh, one place, a fixed order."""
