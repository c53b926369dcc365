"""Device checks on torch that both the probe and the layer profile run (a GEMM rate, a copy bandwidth)."""
