"""What a user attaches: the Trainer callback, the accelerate plugin, diffusion loops."""
