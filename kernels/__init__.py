"""flexserve's Triton kernels, imported as `flexserve_kernels` (a PyPI package owns `kernels`).

Every kernel has a private `@triton.jit` function, a launcher that checks its inputs, and a torch
reference that is the test oracle and the CPU path.
"""
