"""Performance: the GPU table, the roofline model, and benchmarks."""
