"""Hot-path kernels: a PyTorch reference (CPU path, test oracle) and Triton kernels on GPU."""
