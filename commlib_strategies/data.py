"""An embedded character-level dataset: lines of zero-padded additions such as "07+45=052\n".

It needs no download, is fully determined by a seed, and has real structure (the line format,
the sum itself) that a tiny GPT picks up quickly: its loss falls visibly within a hundred steps.
"""
import random

import numpy as np
import torch

VOCAB = "0123456789+=\n"


def vocab_size():
    return len(VOCAB)


def encode(text):
    """Characters -> token ids; every character must be in VOCAB."""
    ids = {ch: i for i, ch in enumerate(VOCAB)}
    unknown = sorted(set(text) - ids.keys())
    if unknown:
        raise ValueError(f"characters {unknown} are not in the vocabulary {VOCAB!r}")
    return [ids[ch] for ch in text]


def decode(ids):
    return "".join(VOCAB[int(i)] for i in ids)


class AdditionDataset:
    """A long stream of "a+b=c\\n" lines, with a and b uniform in [0, 10**max_digits).

    Operands are zero-padded to max_digits and the sum to max_digits + 1, so every line has
    the same layout; a tiny model learns that layout fast, which makes a falling loss a quick
    and reliable training check (with unpadded 3-digit operands it falls much more slowly).

    ``batch(step, ...)`` depends only on the seed and its arguments, never on earlier calls,
    so every parallel layout fetches exactly the same global batch at the same step.
    """

    def __init__(self, seed, max_digits=2, num_chars=200_000):
        if max_digits < 1:
            raise ValueError(f"max_digits must be at least 1, got {max_digits}")
        self.seed = seed
        self.max_digits = max_digits
        rng = random.Random(seed)
        width = max_digits
        line_length = 3 * width + 4  # two operands, a sum one digit wider, "+", "=", "\n"
        lines = []
        for _ in range(-(-num_chars // line_length)):  # enough lines for num_chars characters
            a, b = rng.randrange(10 ** width), rng.randrange(10 ** width)
            lines.append(f"{a:0{width}}+{b:0{width}}={a + b:0{width + 1}}\n")
        self.tokens = np.array(encode("".join(lines)), dtype=np.uint8)

    def __len__(self):
        return len(self.tokens)

    def batch(self, step, batch_size, seq_len):
        """(inputs, targets), int64 tensors of shape (batch_size, seq_len), targets shifted by one.

        Windows start at random offsets drawn from a generator seeded by (seed, step). The
        tensors are on torch's default device.
        """
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        if seq_len + 1 > len(self.tokens):
            raise ValueError(f"seq_len {seq_len} is too long for a stream of {len(self)} tokens")
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - seq_len, size=batch_size)
        windows = self.tokens[starts[:, None] + np.arange(seq_len + 1)]
        windows = torch.from_numpy(windows).long().to(torch.get_default_device())
        return windows[:, :-1], windows[:, 1:]


def shard(tensor, index, count):
    """Rows of ``tensor`` that rank ``index`` of ``count`` owns: an equal contiguous slice of dim 0.

    Returns a view. The batch size must divide evenly so every rank sees the same amount of data
    and the mean of the per-rank losses equals the global mean.
    """
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is out of range for {count} shards")
    size = tensor.shape[0]
    if size % count:
        raise ValueError(f"batch size {size} does not divide by dp={count}; "
                         f"use a multiple of {count}")
    per_rank = size // count
    return tensor[index * per_rank:(index + 1) * per_rank]
