"""Plain names, tables and wrapper detection: no policy, no torch state."""
