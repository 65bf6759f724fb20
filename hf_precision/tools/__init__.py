"""The command line (audit, doctor, checkpoints) and the diagnoses it prints."""
