"""Megatron integration: the `--auto-parallel` hook, re-ranking, and the CPU rehearsal mode."""
