"""The training loop (trainer.py) and checkpoints (checkpoint.py)."""
