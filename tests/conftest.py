import os

# Kernels are @triton.jit functions; without a GPU the interpreter must be chosen before
# they are decorated, i.e. before `kernels` is imported anywhere in the test session.
# Dispatch still goes by tensor device, so CPU callers (the engine) use the references.
if not os.environ.get("CUDA_VISIBLE_DEVICES_FORCE_GPU"):
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
