"""watch/."""
