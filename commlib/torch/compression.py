"""A DDP communication hook that averages each gradient bucket through a compressed
all_reduce (commlib/compressed.py) with error feedback, for the "commlib" backend:

    ddp.register_comm_hook(CompressedBuckets(group, "int8"), compressed_hook)

and FSDP2's gradient reduce-scatter and parameter all-gather through compressed ones
(torch's places for them: FSDPModule.set_custom_reduce_scatter and set_custom_all_gather),
one per FSDP module, each reduce-scatter with its feedback:

    for module in fsdp_modules:
        module.set_custom_reduce_scatter(CompressedReduceScatter("int8"))
        module.set_custom_all_gather(CompressedAllGather("bf16"))

A compressed all-gather carries every rank's shard in the wire format, its own included, so
that every rank computes with the same (rounded) parameters, as ZeRO++'s qwZ does; the
shards themselves, which the optimizer updates, stay exact.

Each bucket keeps its own ErrorFeedback (DDP rebuilds its buckets once, after the first
iteration: a bucket whose size changed starts a fresh one). The all_reduces run on one
thread of the state's, in the order DDP hands the buckets over, so that backward goes on
computing while a bucket is on the wire; DDP waits for their futures at backward's end.
state_dict() and load_state_dict() carry the residuals through a checkpoint.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from .. import compressed
from .work import dist_error


class CompressedBuckets:
    """The hook's state: the group, the wire format, each bucket's error feedback."""

    def __init__(self, group=None, wire="int8", feedback: bool = True):
        from .backend import ProcessGroupCommlib
        self.group = group if group is not None else dist.group.WORLD
        if not isinstance(self.group, ProcessGroupCommlib):
            raise TypeError(f"CompressedBuckets needs a group of the commlib backend, got "
                            f"{self.group!r}; create it with backend='commlib'")
        self.wire = compressed.as_wire(wire)
        # the compressed calls' own communicator (collective: every rank makes its state):
        # DDP's own calls on the group (find_unused_parameters' map) must not meet them
        self.comm = self.group.comm.dup()
        self.feedback: dict | None = {} if feedback else None  # bucket index -> ErrorFeedback
        self.bytes_sent = 0  # packed bytes this rank sent, over every bucket so far
        self.background = compressed.Background()

    def feedback_for(self, index: int, count: int) -> compressed.ErrorFeedback | None:
        if self.feedback is None:
            return None
        held = self.feedback.get(index)
        if held is None or (held.worker is not None and held.worker.size != count):
            held = self.feedback[index] = compressed.ErrorFeedback()  # (rebuilt buckets)
        return held

    def state_dict(self) -> dict:
        return {"wire": self.wire.format, "block": self.wire.block,
                "feedback": None if self.feedback is None else
                {i: f.state_dict() for i, f in self.feedback.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.wire = compressed.Wire(state["wire"], state["block"])
        if state["feedback"] is None:
            self.feedback = None
            return
        self.feedback = {}
        for index, saved in state["feedback"].items():
            self.feedback[int(index)] = held = compressed.ErrorFeedback()
            held.load_state_dict(saved)

    def submit(self, fn) -> torch.futures.Future:
        """``fn()`` on the state's thread, after what was submitted before; its result
        (or its error, as torch's) completes the future."""
        future = torch.futures.Future()

        def finished(done):
            error = done.exception()
            if error is None:
                future.set_result(done.result())
            else:
                future.set_exception(dist_error(error))
        self.background.submit(fn).future.add_done_callback(finished)
        return future


def compressed_hook(state: CompressedBuckets,
                    bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s gradients over the group in ``state.wire`` with its feedback."""
    buffer = bucket.buffer()
    if buffer.dtype != torch.float32:
        raise TypeError(f"compressed_hook compresses float32 buckets, not {buffer.dtype}: "
                        f"keep the model's gradients in float32, or use DDP's own hooks")
    feedback = state.feedback_for(bucket.index(), buffer.numel())
    comm = state.comm
    # a CUDA bucket is encoded on the device (commlib/compressed_device.py), in the order of
    # the stream backward computes it on: the state's thread runs the call on that stream
    stream = torch.cuda.current_stream(buffer.device) if buffer.is_cuda else None

    def reduce():
        before = comm.bytes_sent
        with nullcontext() if stream is None else torch.cuda.stream(stream):
            compressed.all_reduce(comm, buffer, state.wire, feedback, op="avg")
        state.bytes_sent += comm.bytes_sent - before
        return buffer
    return state.submit(reduce)


class FSDPComm:
    """What FSDP2's compressed communications share: the wire format, a communicator of
    their own (made at the first call, which every rank reaches at the same point of
    forward or backward, from FSDP's group on the commlib backend), the bytes sent."""

    def __init__(self, wire):
        self.wire = compressed.as_wire(wire)
        self.comm = None
        self.bytes_sent = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def communicator(self, group: dist.ProcessGroup):
        from .backend import ProcessGroupCommlib
        if self.comm is None:
            if not isinstance(group, ProcessGroupCommlib):
                raise TypeError(f"{type(self).__name__} needs FSDP's group on the commlib "
                                f"backend, got {group!r}: build the mesh on it")
            self.comm = group.comm.dup()
        return self.comm

    def counted(self, fn) -> None:
        """``fn(comm)``, its bytes sent counted."""
        before = self.comm.bytes_sent
        fn(self.comm)
        self.bytes_sent += self.comm.bytes_sent - before


class CompressedReduceScatter(FSDPComm, ReduceScatter):
    """FSDP2's reduce-scatter of one module's gradients in ``wire`` with error feedback
    (``feedback``): float32 gradients, on the CPU or a GPU, op sum or avg."""

    def __init__(self, wire="int8", feedback: bool = True):
        super().__init__(wire)
        self.feedback = compressed.ErrorFeedback() if feedback else None

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> None:
        self.communicator(group)
        name = "sum" if op == dist.ReduceOp.SUM else "avg" if op == dist.ReduceOp.AVG else None
        if name is None:
            raise ValueError(f"CompressedReduceScatter sums or averages, not {op}: leave "
                             f"FSDP's reduce op as it is (sum or avg)")
        self.counted(lambda comm: compressed.reduce_scatter(
            comm, output_tensor, input_tensor, self.wire, self.feedback, op=name))
        return None


class CompressedAllGather(FSDPComm, AllGather):
    """FSDP2's all-gather of one module's parameters in ``wire`` (qwZ-like; no feedback:
    each gather rounds the exact shards afresh): float32 parameters, on the CPU or (encoded
    there, commlib/compressed_device.py) a GPU."""

    def __init__(self, wire="bf16"):
        super().__init__(wire)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        self.communicator(group)
        if input_tensor.dtype != torch.float32:
            raise TypeError(f"CompressedAllGather compresses float32 parameters, but FSDP "
                            f"gathers this module's as {input_tensor.dtype} (parameters of "
                            f"several dtypes go as bytes): keep the module's parameters "
                            f"float32, or leave its all-gather uncompressed")
        self.counted(lambda comm: compressed.all_gather(
            comm, output_tensor, input_tensor, self.wire))
        return None
