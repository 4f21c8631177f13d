import os

import torch

# Without a GPU, Triton kernels can only run through its interpreter, and Triton decides interpreter-or-compiler
# when it is imported (its own tl.cumsum / tl.sum are decorated then): set the switch before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
