"""Reports: JSON/text files, W&B, pictures."""
