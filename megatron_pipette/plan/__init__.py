"""Search and rank placement: turn the cost model into a plan (pure, torch-free)."""
