"""The CPU engine: the lean forward, the compute paths and their conversions, the native kernels (csrc/)."""
