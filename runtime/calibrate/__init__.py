"""Measuring this machine: the bucket tuner and cluster projection (tune/), the length-cost fit (length_cost.py)."""
