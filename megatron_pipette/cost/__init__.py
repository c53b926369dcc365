"""Cost model: memory, compute, communication and pipeline schedules (pure, torch-free)."""
