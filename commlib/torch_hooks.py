"""A DDP communication hook for the "commlib" backend: DDP's own all-reduce (divide by the
group size, then sum), with each gradient bucket's buffer registered with the group's
communicator first (Communicator.register), so that among the GPU ranks of one host the
bucket's all-reduce reads and writes the peers' buckets directly (zero-copy) instead of
copying through the IPC workspace:

    ddp.register_comm_hook(RegisteredBuckets(group), zero_copy_hook)

On CPU tensors, or where registration is impossible (ranks on several hosts, no CUDA
IPC), it is DDP's default all-reduce.
"""
import torch
import torch.distributed as dist


class RegisteredBuckets:
    """The hook's state: the group, and each bucket's registered buffer by bucket index."""

    def __init__(self, group=None):
        from .torch_backend import ProcessGroupCommlib
        self.group = group if group is not None else dist.group.WORLD
        if not isinstance(self.group, ProcessGroupCommlib):
            raise TypeError(f"RegisteredBuckets needs a group of the commlib backend, got "
                            f"{self.group!r}; create it with backend='commlib'")
        self.registered: dict = {}  # bucket index -> RegisteredMemory
        self.possible = True  # False once a registration failed (on every rank alike)

    def hold(self, index: int, buffer: torch.Tensor) -> None:
        """Register ``buffer`` as bucket ``index``'s unless it is already. DDP keeps a
        bucket's buffer across iterations, but rebuilds its buckets once (after the
        first): the new buffer is registered then, and the old one closed. Collective, in
        bucket order like DDP's all-reduces, so every rank does the same."""
        held = self.registered.get(index)
        if held is not None:
            if (held.registration.ptr, held.registration.nbytes) == (buffer.data_ptr(),
                                                                     buffer.nbytes):
                return
            del self.registered[index]
            held.close()
        held = self.group.comm.register(buffer, required=False)
        if held is None:  # not here: the all-reduce copies through the slots
            self.possible = False
        else:
            self.registered[index] = held


# DDP checks the return annotation itself (so no postponed annotations in this module)
def zero_copy_hook(state: RegisteredBuckets,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if buffer.is_cuda and state.possible:
        state.hold(bucket.index(), buffer)
    buffer.div_(state.group.size())
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])
