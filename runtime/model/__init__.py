"""The BERT model: modules (bert.py), its config (config.py), HF-format weights (hf.py)."""
