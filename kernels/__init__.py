"""Triton kernels (chunked linear attention) with naive references and PyTorch CPU paths."""
