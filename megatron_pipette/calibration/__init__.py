"""Predictions held against the job: the self-check's comparison and the model's calibration (torch-free)."""
