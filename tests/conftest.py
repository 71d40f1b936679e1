"""Session-wide test setup."""

import os

import torch

# Triton kernels run on CPU tensors through Triton's interpreter. It must be chosen
# before triton is first imported, so it is set here, for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
