"""One replica group (one process) of torchft's Fault Tolerant DDP with commlib's
reconfigurable process group (commlib/torch/ft.py) carrying the replicas' gradients.

Trains a small model to STEPS steps on data that depends on (replica, step); with DIE_AT
>= 0, SIGKILLs itself once torchft's step reaches it (the test restarts it, and it heals
from the live replica). Writes REPORT: the final step, the steps whose update was not
committed, the quorum sizes seen, the ops commlib carried, and the parameters.

Usage: python tests/mpi/torchft_ddp.py LIGHTHOUSE REPLICA STEPS DIE_AT REPORT
"""
import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torchft import Manager
from torchft.ddp import DistributedDataParallel
from torchft.optim import OptimizerWrapper

import commlib.torch.backend
from commlib.torch.ft import ProcessGroupCommlibFT

lighthouse, replica, steps, die_at, report = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                              int(sys.argv[4]), sys.argv[5])
torch.manual_seed(0)  # every replica starts alike (torchft also syncs a joining one)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
manager = Manager(
    pg=ProcessGroupCommlibFT(timeout=timedelta(seconds=20)), min_replica_size=2,
    load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                               optimizer.load_state_dict(s["optim"])),
    state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
    replica_id=f"replica{replica}", store_addr="localhost", store_port=store.port, rank=0,
    world_size=1, lighthouse_addr=lighthouse, timeout=timedelta(seconds=20),
    quorum_timeout=timedelta(seconds=30))
ddp = DistributedDataParallel(manager, model)
wrapped = OptimizerWrapper(manager, optimizer)
uncommitted, quorums, carried = [], [], []
commlib.torch.backend.set_trace_hook(lambda group, op, work: carried.append(op))
while manager.current_step() < steps:
    step = manager.current_step()
    if step >= die_at >= 0:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(1000 * replica + step)
    x, y = torch.randn(4, 8, generator=g), torch.randint(4, (4,), generator=g)
    wrapped.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    quorums.append(manager.num_participants())
    if manager.should_commit():  # (False where the allreduce failed: the step is redone)
        optimizer.step()
    else:
        uncommitted.append(step)
with open(report, "w") as f:
    json.dump({"step": manager.current_step(), "uncommitted": uncommitted, "quorums": quorums,
               "commlib_ops": len(carried),
               "params": [p.tolist() for p in model.parameters()]}, f)
manager.shutdown(wait=False)
