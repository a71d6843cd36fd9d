"""A DDP communication hook for the "commlib" backend: DDP's own all-reduce (divide by the
group size, then sum), without copies through staging:

    ddp.register_comm_hook(RegisteredBuckets(group), zero_copy_hook)

- GPU buckets are registered with the group's communicator (Communicator.register), so
  that among the GPU ranks of one host the bucket's all-reduce reads and writes the peers'
  buckets directly instead of copying through the IPC workspace;
- CPU buckets are divided into a twin in memory every rank of the host maps
  (Communicator.empty), whose all-reduce (one_copy) reads the peers' twins where they
  lie; DDP copies the result into the gradients, as after any hook.

Where neither is possible (ranks on several hosts, no CUDA IPC, no shared memory), it is
DDP's default all-reduce.
"""
import torch
import torch.distributed as dist

from .work import dist_error


class RegisteredBuckets:
    """The hook's state: the group, and each bucket's registered buffer by bucket index."""

    def __init__(self, group=None):
        from .backend import ProcessGroupCommlib
        self.group = group if group is not None else dist.group.WORLD
        if not isinstance(self.group, ProcessGroupCommlib):
            raise TypeError(f"RegisteredBuckets needs a group of the commlib backend, got "
                            f"{self.group!r}; create it with backend='commlib'")
        self.registered: dict = {}  # bucket index -> RegisteredMemory
        self.possible = True  # False once a registration failed (on every rank alike)
        self.twins: dict = {}  # bucket index -> its CPU twin in shared memory
        comm = self.group.comm
        self.shares_host_memory = "one_copy" in comm.algorithms("all_reduce")

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

    def twin(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        """Bucket ``index``'s twin in shared host memory, made (collectively, in bucket
        order) at its first all-reduce and again when DDP rebuilds its buckets."""
        twin = self.twins.get(index)
        if twin is None or (twin.numel(), twin.dtype) != (buffer.numel(), buffer.dtype):
            twin = self.twins[index] = self.group.comm.empty(buffer.numel(), buffer.dtype)
        return twin


# DDP checks the return annotation itself (so no postponed annotations in this module)
def zero_copy_hook(state: RegisteredBuckets,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if buffer.is_cuda and state.possible:
        state.hold(bucket.index(), buffer)
    elif not buffer.is_cuda and state.shares_host_memory:
        twin = state.twin(bucket.index(), buffer)
        torch.div(buffer, state.group.size(), out=twin)
        work = state.group.comm.all_reduce(twin, algorithm="one_copy", async_op=True)
        future = torch.futures.Future()
        work.add_done_callback(lambda done: future.set_exception(dist_error(done.exception()))
                               if done.exception() else future.set_result(twin))
        return future
    buffer.div_(state.group.size())
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])
