"""GSA (Gated Slot Attention), chunked (kernels/gsa/README.md): chunk_gsa (Triton on CUDA, PyTorch on CPU;
chunk.py), the same from the model's stacked projection with its feature maps (chunk_gsa_from_projection,
projection.py), the token-by-token reference naive_gsa and the PyTorch chunked path chunk_gsa_torch."""

from kernels.gsa.chunk import chunk_gsa
from kernels.gsa.naive import naive_gsa
from kernels.gsa.projection import chunk_gsa_from_projection, feature_maps
from kernels.gsa.torch_chunk import chunk_gsa_torch

__all__ = ["chunk_gsa", "chunk_gsa_from_projection", "feature_maps", "naive_gsa", "chunk_gsa_torch"]
