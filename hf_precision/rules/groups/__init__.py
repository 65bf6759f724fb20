"""rules/groups/."""
