"""Calls for tests/test_trace.py to trace (COMMLIB_TRACE is set by the test): the fast
path's and the general path's collectives, async ones, and a communicator split off the
world; the test merges what every rank wrote."""
import time

import numpy as np

import commlib
from commlib.trace import region

world = commlib.init()
x = np.ones(1000, np.float32)
for _ in range(3):
    world.all_reduce(x)  # small: the C++ fast path
world.all_reduce(np.ones(1 << 18, np.float32), algorithm="ring")  # the general path
world.barrier()
if world.rank == 1:  # (the rank whose clock runs ahead) the others wait for it
    time.sleep(0.2)
world.all_reduce(np.ones(10))
world.broadcast(x, root=world.size - 1)
half = world.split(world.rank % 2)
half.all_reduce(np.ones(10))
with region("overlap"):
    work = world.all_gather(np.empty(1000 * world.size, np.float32), x, async_op=True)
    work.wait()
world.barrier()
