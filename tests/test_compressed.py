"""The wire formats' kernels (csrc/wire.cpp) against numpy's and torch's rounding
(tests/wire_reference.py); multi-rank collectives: tests/mpi/compressed.py."""
import numpy as np
import pytest

from commlib import compressed
from wire_reference import TORCH_FP8, round_trip, summed

FORMATS = ["bf16", "fp16", "int8", "fp8_e4m3", "fp8_e5m2"]


def data(count, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(count) * np.exp(rng.uniform(-8, 8, count))).astype(np.float32)
    x[64:128] = 0  # a block of zeros (scale 0)
    x[200:264] *= np.float32(1e-30)  # tiny values: the 8-bit floats' subnormals
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block", [32, 64, 128, 256])
def test_a_packet_decodes_to_the_formats_rounding_and_the_residual_keeps_the_rest(fmt, block):
    x, carried = data(1003), data(1003, 1) * np.float32(1e-3)
    residual = carried.copy()
    wire = compressed.Wire(fmt, block)
    packet = wire.encode(x, residual)
    y = x + carried
    want = round_trip(y, fmt, block)
    got = np.empty_like(x)
    wire.decode_sum(got, [packet.ctypes.data])
    assert np.array_equal(got, want)
    assert np.array_equal(residual, y - want)
    blocks = -(-x.size // block) if fmt in compressed.SCALED else 0
    assert packet.size == (2 * x.size if fmt in ("bf16", "fp16") else x.size + 4 * blocks)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packets_sum_in_order_in_float32(fmt):
    wire = compressed.Wire(fmt, 64)
    xs = [data(515, seed) for seed in range(3)]
    packets = [wire.encode(x) for x in xs]
    got = np.empty(515, np.float32)
    wire.decode_sum(got, [p.ctypes.data for p in packets], 1 / 3)
    want = summed([round_trip(x, fmt, 64) for x in xs], np.float32(1 / 3))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("fmt", sorted(TORCH_FP8))
def test_every_8_bit_float_code_decodes_as_torchs_own(fmt):
    import torch
    codes = np.arange(256, dtype=np.uint8)
    packet = np.concatenate([np.ones(4, np.float32).view(np.uint8), codes])  # 4 scales of 1
    got = np.empty(256, np.float32)
    compressed.Wire(fmt, 64).decode_sum(got, [packet.ctypes.data])
    want = torch.from_numpy(codes.copy()).view(TORCH_FP8[fmt]).to(torch.float32).numpy()
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_sum_encode_is_decode_sum_then_encode_in_one_pass(fmt):
    wire = compressed.Wire(fmt, 32)
    packets = [wire.encode(data(777, seed)) for seed in range(3)]
    addresses = [p.ctypes.data for p in packets]
    residual = data(777, 5) * np.float32(1e-3)
    total, want_residual = np.empty(777, np.float32), residual.copy()
    wire.decode_sum(total, addresses, 0.5)
    want = wire.encode(total, want_residual)
    got = np.full(want.size, 0xAA, np.uint8)
    wire.sum_encode(got, addresses, 777, residual, 0.5)
    assert np.array_equal(got, want)
    assert np.array_equal(residual, want_residual)
    wire.sum_encode(got, addresses, 777, None, 0.5)  # without error feedback
    assert np.array_equal(got, wire.encode(total))


@pytest.mark.parametrize("fmt", sorted(compressed.SCALED))
def test_a_block_holding_nan_or_inf_decodes_as_nan_not_as_numbers(fmt):
    x = np.ones(128, np.float32)
    x[70] = np.inf
    x[3] = np.nan
    wire = compressed.Wire(fmt, 64)
    got = np.empty_like(x)
    wire.decode_sum(got, [wire.encode(x).ctypes.data])
    assert np.isnan(got).all()


def test_bad_formats_and_blocks_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown wire format 'int4'; known: bf16"):
        compressed.Wire("int4")
    with pytest.raises(ValueError, match="int8 takes a block of 32, 64, 128, 256"):
        compressed.Wire("int8", 100)
    feedback = compressed.ErrorFeedback()
    feedback.residual("worker", 10, "all_reduce")
    with pytest.raises(ValueError, match="holds a worker residual of 10 float32 elements, "
                                         "the call needs 12"):
        feedback.residual("worker", 12, "all_reduce")
