"""Compressed collectives on GPU arrays (torch CUDA tensors, CuPy arrays): encoded and
decoded on the device by commlib/cuda/wire.cu's kernels, which make csrc/wire.cpp's
packets bit for bit, and carried between the ranks through host memory by the
communicator, as the CPU's packets are (any transport, across hosts). So only packets
cross PCIe, never the float32 data, and a GPU rank and a CPU rank meet in one call.

    all_reduce      per piece (wire.PIECE elements): the data (+ the worker residual, kept on
                    the device) encoded on the device, part j for rank j; the packets to
                    the host; the exchange, the owner's decode + sum + encode (on the CPU,
                    the server residual in host memory) and the gather as on CPU data; the
                    gathered packets back to the device, decoded into the data there.
    reduce_scatter  encoded on the device, exchanged, decoded and summed on the device.
    all_gather      encoded on the device, gathered, decoded on the device.

A call runs on the array's current stream and is synchronous for its caller, as the CPU
calls are: it waits for that stream before the packets leave (work enqueued before the
call is in them), and returns once the result is on the device. all_reduce's pieces are
pipelined as on the CPU (commlib/compressed_pipeline.py): while one piece's packets are
on the wire, the next is encoded and the one before decoded, on the array's stream.
"""
from __future__ import annotations

import numpy as np

from . import compressed_pipeline, cuda
from .wire import ErrorFeedback, as_wire, cut_pieces, parts, reduce_factor, server_residual


def on_device(x) -> bool:
    """Whether ``x`` is GPU data: a CUDA tensor, or an array with __cuda_array_interface__."""
    if hasattr(x, "is_cuda") and hasattr(x, "data_ptr"):
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")


class DeviceMemory:
    """``nbytes`` of memory on ``like``'s device, uninitialised (a part's padding is never
    read): torch's (its caching allocator) where ``like`` is a torch tensor's, else the
    runtime's (freed with the object)."""

    def __init__(self, like: cuda.DeviceArray, nbytes: int):
        self.device, self.nbytes, self._runtime = like.device, nbytes, None
        if like.framework == "torch":
            import torch
            self._tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8,
                                       device=f"cuda:{like.device}")
            self.ptr = self._tensor.data_ptr()
            return
        self._runtime = cuda.streams()
        self.ptr = self._runtime.device_alloc(max(nbytes, 1), like.device)

    def __del__(self):
        if self._runtime is not None:
            self._runtime.device_free(self.ptr, self.device)


class DeviceResidual:
    """An ErrorFeedback residual kept on the device: ``size`` float32 elements. ``copy()``
    is its host copy (what ErrorFeedback's state_dict holds)."""
    dtype = np.dtype(np.float32)

    def __init__(self, like: cuda.DeviceArray, host: np.ndarray):
        self.size, self.device = host.size, like.device
        self.memory = DeviceMemory(like, 4 * host.size)
        self.ptr = self.memory.ptr
        _to_device(like, self.ptr, host)
        _synchronize(like)

    def copy(self) -> np.ndarray:
        host = np.empty(self.size, np.float32)
        runtime, stream = cuda.streams(), _stream_of(self.device)
        runtime.copy_async(host.ctypes.data, self.ptr, host.nbytes, self.device, stream)
        runtime.stream_synchronize(stream, self.device)
        return host


def all_reduce(comm, data, wire, feedback: ErrorFeedback | None, op: str, piece: int):
    """commlib.compressed.all_reduce on GPU data (see the module's doc)."""
    wire, factor, n, rank = as_wire(wire), reduce_factor(op, comm.size), comm.size, comm.rank
    array = _float32(data, "all_reduce")
    pieces = cut_pieces(array.count, piece)
    if n == 1:
        return data
    worker = feedback and _worker_residual(feedback, array, array.count, "all_reduce")
    server, server_at = server_residual(feedback, pieces, n, rank)
    codec = DeviceCodec(wire, array, worker, n, pieces[0][1])
    try:  # (an error's too: the stream passes the host's packets before they are freed)
        compressed_pipeline.all_reduce(comm, wire, pieces, codec, server, server_at, factor)
    finally:
        _synchronize(array)
    return data


class DeviceCodec:
    """all_reduce's pieces of ``array`` (on its device) encoded there with the worker
    residual, the packets copied to the host, and decoded there: on the array's stream,
    in the pipeline's order, so one device memory (for the largest piece, ``most``
    elements: the first) serves every piece; the gathered host packets are kept until the
    stream has passed them (the next encode's copy waits for it)."""

    def __init__(self, wire, array, worker, n: int, most: int):
        self.wire, self.array, self.worker = wire, array, worker
        widest = max(wire.packet_bytes(c) for _, c in parts(most, n))
        self.memory = DeviceMemory(array, n * widest)
        self.held: list = []

    def encode(self, start: int, count: int, cut: list) -> tuple:
        width = max(self.wire.packet_bytes(c) for _, c in cut)
        for j, (at, c) in enumerate(cut):
            _encode(self.array, self.wire, start + at, c, self.worker,
                    self.memory.ptr + j * width)
        packets = _to_host(self.array, self.memory.ptr, len(cut) * width)
        self.held.clear()  # (the stream has passed every decode before this encode)
        return packets, width

    def decode(self, start: int, cut: list, width: int, gathered: np.ndarray) -> None:
        self.held.append(gathered)
        _to_device(self.array, self.memory.ptr, gathered)
        for j, (at, c) in enumerate(cut):
            _decode_sum(self.array, self.wire, start + at, c, [self.memory.ptr + j * width],
                        1.0)


def reduce_scatter(comm, output, input, wire, feedback: ErrorFeedback | None, op: str):
    """commlib.compressed.reduce_scatter on GPU data."""
    wire, factor, n = as_wire(wire), reduce_factor(op, comm.size), comm.size
    inp, out = _float32(input, "reduce_scatter"), _float32(output, "reduce_scatter")
    _whole_of(inp, out, n, "reduce_scatter", "input", "output")
    worker = feedback and _worker_residual(feedback, inp, inp.count, "reduce_scatter")
    width = wire.packet_bytes(out.count)
    memory = DeviceMemory(inp, n * width)
    for j in range(n):
        _encode(inp, wire, j * out.count, out.count, worker, memory.ptr + j * width)
    got = np.empty(n * width, np.uint8)
    comm.all_to_all(got, _to_host(inp, memory.ptr, n * width))
    _to_device(inp, memory.ptr, got)
    packets = [memory.ptr + j * width for j in range(n)]
    if n <= cuda.MAX_POINTERS:
        _decode_sum(out, wire, 0, out.count, packets, factor)
    else:  # more packets than a kernel takes: summed on the host, in the same order
        host = np.empty(out.count, np.float32)
        wire.decode_sum(host, [got.ctypes.data + j * width for j in range(n)], factor)
        _to_device(out, out.ptr, host)
    _synchronize(inp)
    return output


def all_gather(comm, output, input, wire, feedback: ErrorFeedback | None):
    """commlib.compressed.all_gather on GPU data."""
    wire, n = as_wire(wire), comm.size
    out, inp = _float32(output, "all_gather"), _float32(input, "all_gather")
    _whole_of(out, inp, n, "all_gather", "output", "input")
    worker = feedback and _worker_residual(feedback, inp, inp.count, "all_gather")
    width = wire.packet_bytes(inp.count)
    memory = DeviceMemory(inp, n * width)
    _encode(inp, wire, 0, inp.count, worker, memory.ptr)
    gathered = np.empty(n * width, np.uint8)
    comm.all_gather(gathered, _to_host(inp, memory.ptr, width))
    _to_device(inp, memory.ptr, gathered)
    for j in range(n):
        _decode_sum(out, wire, j * inp.count, inp.count, [memory.ptr + j * width], 1.0)
    _synchronize(inp)
    return output


def _float32(data, what: str) -> cuda.DeviceArray:
    array = cuda.device_array(data, f"compressed {what}")
    if array.dtype.name != "float32":
        raise TypeError(f"compressed {what} takes float32 data, not {array.dtype.name}: the "
                        f"wire formats carry float32 (cast it, or call the uncompressed "
                        f"collective)")
    return array


def _whole_of(whole, block, n: int, what: str, whole_name: str, block_name: str) -> None:
    if whole.count != n * block.count:
        raise ValueError(f"compressed {what}: {whole_name} has {whole.count} elements, "
                         f"needs {n} x the {block_name}'s {block.count}")
    if whole.device != block.device:
        raise ValueError(f"compressed {what}: {whole_name} is on device {whole.device}, "
                         f"{block_name} on {block.device}; put them on one")


def _worker_residual(feedback: ErrorFeedback, array, count: int, what: str) -> DeviceResidual:
    """The worker residual, on ``array``'s device (moved there the first time, from the
    host or from another device)."""
    held = feedback.worker
    if isinstance(held, DeviceResidual) and held.device == array.device and held.size == count:
        return held
    feedback.worker = DeviceResidual(array, feedback.residual("worker", count, what))
    return feedback.worker


def _encode(array, wire, start: int, count: int, residual, packet: int) -> None:
    if count:
        cuda.streams().wire_encode(array.ptr + 4 * start,
                                   0 if residual is None else residual.ptr + 4 * start, packet,
                                   count, wire.code, wire.block, array.device, array.stream)


def _decode_sum(array, wire, start: int, count: int, packets: list, factor: float) -> None:
    """``array``'s elements [start, start + count) <- factor x the packets' sum."""
    if count:
        cuda.streams().wire_decode_sum(array.ptr + 4 * start, packets, count, wire.code,
                                       wire.block, factor, array.device, array.stream)


def _to_host(array, ptr: int, nbytes: int) -> np.ndarray:
    """``nbytes`` at device address ``ptr``, once the array's stream has got there."""
    host = np.empty(nbytes, np.uint8)
    cuda.streams().copy_async(host.ctypes.data, ptr, nbytes, array.device, array.stream)
    _synchronize(array)
    return host


def _to_device(array, ptr: int, host: np.ndarray) -> None:
    """``host`` to device address ``ptr``, enqueued on the array's stream (``host`` must
    live until the stream has passed it: the calls synchronise before they return)."""
    cuda.streams().copy_async(ptr, host.ctypes.data, host.nbytes, array.device, array.stream)


def _synchronize(array) -> None:
    cuda.streams().stream_synchronize(array.stream, array.device)


def _stream_of(device: int) -> int:
    """The current stream of torch on ``device`` where torch has CUDA, else the default."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.current_stream(device).cuda_stream
    except ImportError:
        pass
    return 0
