"""Benchmarks: each prints a table with its peer measured in the same run and writes JSON."""
