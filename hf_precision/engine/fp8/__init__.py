"""engine/fp8/."""
