"""What a GPU machine runs (README.md here): shell launchers for calibration and validation steps,
and the recap printed last."""
