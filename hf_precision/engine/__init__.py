"""Plan, apply, and the guards and checks that run during training."""
