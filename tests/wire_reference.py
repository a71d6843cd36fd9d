"""numpy (and torch, for the 8-bit floats' rounding) references of csrc/wire.h's formats:
what an encoded block decodes to, computed step by step in float32 as the kernel must."""
import numpy as np
import torch

LARGEST = {"int8": np.float32(127), "fp8_e4m3": np.float32(448), "fp8_e5m2": np.float32(57344)}
TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def round_trip(y: np.ndarray, fmt: str, block: int) -> np.ndarray:
    """What float32 ``y`` decodes to after encoding in ``fmt`` (blocks from its start)."""
    y = np.asarray(y, np.float32)
    if fmt == "bf16":
        return torch.from_numpy(y.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    if fmt == "fp16":
        return y.astype(np.float16).astype(np.float32)
    out = np.empty_like(y)
    for at in range(0, y.size, block):
        b = y[at:at + block]
        most = np.abs(b).max() if np.isfinite(b).all() else np.float32(np.nan)
        most = np.float32(most)
        scale = most / LARGEST[fmt]
        if scale == 0:
            out[at:at + block] = 0
            continue
        with np.errstate(over="ignore", invalid="ignore"):
            up = np.minimum(LARGEST[fmt] / most, np.finfo(np.float32).max)
        v = (b * up).astype(np.float32)
        if fmt == "int8":
            q = np.clip(np.rint(v), -127, 127).astype(np.float32)
        else:
            q = torch.from_numpy(v.copy()).to(TORCH_FP8[fmt]).to(torch.float32).numpy()
        out[at:at + block] = (q * scale).astype(np.float32)
    return out


def summed(decoded: list, factor: float = 1.0) -> np.ndarray:
    """Their float32 sum in order, then times ``factor`` (unless 1), as decode_sum does."""
    acc = np.zeros_like(decoded[0])
    for d in decoded:
        acc = (acc + d).astype(np.float32)
    return acc if factor == 1.0 else (acc * np.float32(factor)).astype(np.float32)
