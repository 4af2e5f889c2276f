"""Benchmarks: each prints what it measured and writes a JSON record to bench/results/."""
