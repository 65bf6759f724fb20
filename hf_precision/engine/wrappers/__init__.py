"""engine/wrappers/."""
