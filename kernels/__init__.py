"""Attention backends (installed as ``radixkv.kernels``).

This package imports nothing from the rest of radixkv. The backends (torch reference,
Triton, FlashInfer) arrive with the model and kernels issues.
"""
