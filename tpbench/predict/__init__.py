"""How a step is predicted without running it: the analytic model of its memory, bytes and FLOPs
(theory/), the GPU table (hardware), the caching allocator's model (allocator) and this machine's
measured matmul rate (rate_probe). Below the experiments, which put predictions beside measurements."""
