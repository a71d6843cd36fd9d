"""commlib in PyTorch, one import: ``import commlib.torch`` registers the torch.distributed
backend "commlib" (backend.py) and gives its entry points; the rest lies in this package's
modules, imported where used: ops.py (dtypes, reduce ops and staging of the backend's
tensors), work.py (its Work objects), hooks.py (DDP's zero-copy hook), compression.py
(compressed DDP hooks and FSDP2 reduce-scatters and all-gathers), ft.py (torchft's
reconfigurable group).

    import commlib.torch
    commlib.torch.init_process_group()   # under mpiexec or torchrun
"""
from .backend import (BACKEND, ProcessGroupCommlib, init_process_group,  # noqa: F401
                      set_trace_hook)
