"""rules/policy/."""
