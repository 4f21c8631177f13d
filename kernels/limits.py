"""The kernels' limits, in a module without torch or Triton: the chunk ops check their inputs against the head sizes,
and the configs (flame/models/args.py, flame/config.py) refuse what the kernels cannot take before anything starts."""

RWKV7_MAX_K = 128
"""Largest key head size of chunk_rwkv7 (V is tiled): at K = 256 the blocked scans' block maps need more shared
memory than an H100 block has (811 KB for _block_scan, sm_90 compile)."""

RWKV6_MAX_K = 256
"""Largest key head size of chunk_rwkv6: its per-chunk kernels hold whole [chunk, K] tiles (V is tiled)."""

GSA_MAX_SLOTS = 256
"""Most slots of chunk_gsa: one tile holds all M of a row (the softmax needs them); K and V are tiled."""

CHUNK_MULTIPLE = 64
"""The recurrent kernels chunk at 16 to 64 tokens: a context-parallel piece a multiple of this keeps every chunk
whole."""
