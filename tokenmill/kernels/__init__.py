"""Triton kernels, each beside a pure-PyTorch reference (the Triton kernels issue)."""
