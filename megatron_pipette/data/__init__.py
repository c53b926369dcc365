"""Data files: the GPU catalog, cluster presets and model presets (JSON)."""
