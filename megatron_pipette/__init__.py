"""megatron-pipette: measured, link-aware parallel-layout planning for Megatron-LM."""

__version__ = "0.1.0"
