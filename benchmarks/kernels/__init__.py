"""Kernel benchmarks (see ../README.md)."""
