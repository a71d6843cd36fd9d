"""transformers' own parallelisms (``from_pretrained(..., distributed_config=...)``: tp,
fsdp, tp x ep, fsdp x ep) on a small random Qwen3 and Qwen3-MoE, under torchrun with the
default group on BACKEND (commlib or gloo): two SGD steps per layout, their losses against
one process's, written to DIR/losses-BACKEND.json for the test to compare with the other
backend's. transformers builds its meshes under fixed names, and DTensor's caches take two
meshes of the same ranks and names for one whatever their backends, so the two backends
run in two launches, not side by side.

Usage: torchrun --nproc-per-node N tests/mpi/transformers_parallel.py BACKEND DIR  (N = 2, 4)
"""
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import commlib.torch.backend as tb
from harness import Checker

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
BACKEND, DIR = sys.argv[1], Path(sys.argv[2])
if BACKEND == "commlib":
    tb.init_process_group()
else:
    dist.init_process_group(BACKEND)
rank, n = dist.get_rank(), dist.get_world_size()

from transformers import (AutoModelForCausalLM, DistributedConfig, Qwen3Config,  # noqa: E402
                          Qwen3MoeConfig)
from transformers.utils import logging  # noqa: E402

logging.set_verbosity_error()
logging.disable_progress_bar()

SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=64)
CONFIGS = {"qwen3": Qwen3Config(**SIZES),
           "qwen3_moe": Qwen3MoeConfig(**SIZES, moe_intermediate_size=16, num_experts=4,
                                       num_experts_per_tok=2, decoder_sparse_step=1,
                                       mlp_only_layers=[])}
LAYOUTS = {2: [("qwen3", dict(tp_size=2)), ("qwen3", dict(fsdp_size=2)),
               ("qwen3_moe", dict(tp_size=2, ep_size=2)),
               ("qwen3_moe", dict(fsdp_size=2, ep_size=2))],
           4: [("qwen3", dict(tp_size=2, fsdp_size=2)),
               ("qwen3_moe", dict(tp_size=2, fsdp_size=2, ep_size=4)),
               ("qwen3_moe", dict(fsdp_size=4, ep_size=4))]}[n]
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
STEPS = 2
check = Checker()
losses: dict = {}


def saved(name: str) -> Path:
    """The model of ``name``, random and saved by rank 0 (the same weights in each launch)."""
    path = DIR / f"{name}-{BACKEND}"
    if rank == 0:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(CONFIGS[name]).save_pretrained(path)
    dist.barrier()
    return path


def train(model) -> list[float]:
    """STEPS SGD steps on IDS: each step's loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(STEPS):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    return out


def layout_case(name: str, sizes: dict):
    def case():
        path = saved(name)
        alone = train(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, distributed_config=DistributedConfig(**sizes))
        sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
        assert sharded, f"{name} {sizes}: no parameter is a DTensor"
        ops = []
        tb.set_trace_hook(lambda group, what, work: ops.append(what))
        try:
            got = train(model)
        finally:
            tb.set_trace_hook(None)
        assert bool(ops) == (BACKEND == "commlib"), f"{len(ops)} ops ran on commlib"
        torch.testing.assert_close(torch.tensor(got), torch.tensor(alone), rtol=1e-5, atol=0)
        losses[f"{name} {sizes}"] = got
    return case


for _name, _sizes in LAYOUTS:
    check.check(f"{_name} {_sizes}", layout_case(_name, _sizes))
if rank == 0:
    (DIR / f"losses-{BACKEND}.json").write_text(json.dumps(losses, indent=1))
check.finish()
