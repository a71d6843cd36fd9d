"""Data parallelism: every rank of a group holds the whole model and a slice of the batch;
gradients are averaged over the group during backward.

Vocabulary: a *bucket* is a flat buffer holding the gradients of several parameters of one
dtype (about ``bucket_bytes``; the first, which backward fills first, about
``first_bucket_bytes``, as torch's DDP: the communication starts after the last layer's
gradients, not after 25 MB of them), in reverse registration order, which is roughly the
order backward produces them. A parameter's gradient is copied into its bucket by a hook as soon
as autograd has accumulated it; a full bucket's all-reduce is launched at once (async), so
it overlaps the rest of backward. Buckets are launched strictly in index order, so every
rank issues the same collectives in the same order even if its gradients arrive in another.
At the end of backward the remaining buckets are launched, all are waited for, and the
averaged gradients are written back to ``param.grad``: after ``loss.backward()`` returns,
the optimizer can step.

On GPUs whose ranks share a host, each bucket is registered with the group
(Communicator.register) once: its all-reduce then reads and writes the peers' buckets
directly (zero-copy), with no copy through the IPC workspace. Host buckets of ranks that
share memory live in memory every rank maps (Communicator.empty), and their all-reduce
(one_copy) reads the peers' buckets in place, with no copy through staging.

With ``compress`` (a wire format: commlib/compressed.py) each bucket's all-reduce carries
its gradients in that format, with an error feedback per bucket (``error_feedback``), on
a thread of its own so that backward goes on meanwhile: float32 buckets on the CPU. A
PowerSGD (commlib/low_rank.py) as ``compress`` averages each bucket's matrices as low-rank
factors instead (its queries and residuals kept per bucket), on the same thread.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

import commlib
from commlib import compressed
from commlib.low_rank import LowRankState, PowerSGD


class _Bucket:
    def __init__(self, params: list, dtype: torch.dtype, group: commlib.Communicator):
        self.params = params
        self.offsets, total = {}, 0
        for p in params:
            self.offsets[p] = total
            total += p.numel()
        device = params[0].device
        # host buckets in memory every rank maps: the all-reduce reads the peers' buckets
        # where they lie (one_copy), with no copy through staging
        self.algorithm = "one_copy" if device.type == "cpu" and "one_copy" in \
            group.algorithms("all_reduce") else None
        if self.algorithm:
            self.flat = group.empty(total, dtype)
            self.flat.zero_()
        else:
            self.flat = torch.zeros(total, dtype=dtype, device=device)
        self.ready: set = set()
        self.work = None

    def view(self, p) -> torch.Tensor:
        return self.flat[self.offsets[p]:self.offsets[p] + p.numel()].view_as(p)


class DataParallel(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, group: commlib.Communicator,
                 bucket_bytes: int = 25 << 20, register_buckets: bool = True,
                 first_bucket_bytes: int = 1 << 20, compress=None,
                 error_feedback: bool = True):
        super().__init__()
        # None, a Wire or a PowerSGD
        self.compress = compress if compress is None or isinstance(compress, PowerSGD) \
            else compressed.as_wire(compress)
        self.error_feedback = error_feedback
        if self.compress is not None:
            for p in module.parameters():
                if p.requires_grad and (p.dtype != torch.float32 or p.device.type != "cpu"):
                    raise TypeError(f"DataParallel(compress={compress!r}) compresses "
                                    f"float32 gradients on the CPU, not {p.dtype} on "
                                    f"{p.device}: keep the model in float32 on the CPU, or "
                                    f"leave compress out")
            self.background = compressed.Background()
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if first_bucket_bytes <= 0:
            raise ValueError(f"first_bucket_bytes must be positive, got {first_bucket_bytes}")
        self.module, self.group = module, group
        self.bucket_bytes, self.register_buckets = bucket_bytes, register_buckets
        self.first_bucket_bytes = min(first_bucket_bytes, bucket_bytes)
        with torch.no_grad():  # every rank starts from rank 0's weights
            for t in list(module.parameters()) + list(module.buffers()):
                group.broadcast(t.data, root=0)
        self._bucket([p for p in module.parameters() if p.requires_grad])
        self._sync = True
        self.launched_during_backward = 0  # buckets whose all-reduce overlapped backward
        for p in self._bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def regroup(self, group: commlib.Communicator) -> None:
        """Go on over ``group`` (the survivors of this one: Communicator.shrink) from the
        next backward, whose gradients it then averages; a backward that failed midway is
        dropped (zero the gradients and redo its step, the batch sharded over ``group``).
        The weights stay as they are: every survivor holds the same."""
        self.group = group
        self._bucket(list(self._bucket_of))

    def _bucket(self, params: list) -> None:
        """``params``' buckets over ``self.group``, none launched yet."""
        self.buckets = _make_buckets(params, self.bucket_bytes, self.first_bucket_bytes,
                                     self.group)
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        # the compressed calls' own communicator (their thread's calls must not meet the
        # group's others), and an error feedback per bucket (a new group, new buckets:
        # they start afresh)
        self.compressed_group = self.group.dup() if self.compress is not None else None
        self.feedback = [LowRankState() if isinstance(self.compress, PowerSGD) else
                         compressed.ErrorFeedback() if self.error_feedback else None
                         for _ in self.buckets]
        self.registered = _register(self.group, self.buckets) if self.register_buckets else []
        self._pending = False  # this backward has hooked, and will finish at its end
        self._next_launch = 0

    def compression_holders(self) -> list:
        """Each bucket's ErrorFeedback or LowRankState (None where nothing is held)."""
        return self.feedback

    @property
    def own_groups(self) -> list:
        """The communicators it made (the compressed calls'): their traffic is its too."""
        return [] if self.compressed_group is None else [self.compressed_group]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the first one outside
        averages the accumulated sum (gradient accumulation)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    # ------------------------------------------------------------------ during backward
    def _on_grad(self, p):
        if not self._sync:
            return
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self._bucket_of[p]
        view = bucket.view(p)
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        bucket.ready.add(p)
        self._launch(until_incomplete=True)

    def _launch(self, until_incomplete: bool) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if until_incomplete and len(bucket.ready) < len(bucket.params):
                return
            if len(bucket.ready) < len(bucket.params):  # unused parameters contribute zeros
                for p in bucket.params:
                    if p not in bucket.ready:
                        bucket.view(p).zero_()
            elif until_incomplete:
                self.launched_during_backward += 1
            if self.compress is not None:
                bucket.work = self.background.submit(self._average_compressed, bucket,
                                                     self.feedback[self._next_launch])
            else:
                bucket.work = self.group.all_reduce(bucket.flat, op="avg", async_op=True,
                                                    algorithm=bucket.algorithm)
            self._next_launch += 1

    def _average_compressed(self, bucket: _Bucket, feedback) -> None:
        """``bucket``'s gradients averaged as ``compress`` carries them (on its thread)."""
        if isinstance(self.compress, PowerSGD):
            self.compress.all_reduce(self.compressed_group,
                                     [bucket.view(p) for p in bucket.params], feedback)
        else:
            compressed.all_reduce(self.compressed_group, bucket.flat, self.compress, feedback,
                                  op="avg")

    def _finish(self):
        self._launch(until_incomplete=False)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
            bucket.ready.clear()
            for p in bucket.params:
                p.grad = bucket.view(p)  # a view: the next backward accumulates in place
        self._next_launch = 0
        self._pending = False


def _make_buckets(params: list, bucket_bytes: int, first_bucket_bytes: int, group) -> list:
    buckets, current, size = [], [], 0
    for p in reversed(params):
        cap = bucket_bytes if buckets else first_bucket_bytes
        if current and (p.dtype != current[0].dtype or size + p.nbytes > cap):
            buckets.append(_Bucket(current, current[0].dtype, group))
            current, size = [], 0
        current.append(p)
        size += p.nbytes
    if current:
        buckets.append(_Bucket(current, current[0].dtype, group))
    return buckets


def _register(group, buckets: list) -> list:
    """The buckets' memory registered with the group, where it can be (GPU memory, ranks of
    one host); the same on every rank, as each registration succeeds or fails on all."""
    registered = []
    for bucket in buckets:
        held = group.register(bucket.flat, required=False)
        if held is None:  # not here: the all-reduce copies through the slots
            break
        registered.append(held)
    return registered
