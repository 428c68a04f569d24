"""Triton kernels for the hot paths, each beside its PyTorch reference; imported as mm_oval.kernels."""
