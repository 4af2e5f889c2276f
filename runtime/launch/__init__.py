"""Where this process sits and how the ranks meet: the launcher's environment (env.py, its only reader), the process group and fault handling (dist.py), stop signals (signals.py)."""
