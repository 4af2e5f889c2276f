"""Optimizers by name (optimizers.py), the fused backend's flat buffers (flat_binding.py), learning-rate schedules (schedules.py), clipping and loss scaling (grad_scale.py)."""
