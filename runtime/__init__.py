"""Presto training engine: config, launch, model, optimizers, trainer (never imports submission)."""
