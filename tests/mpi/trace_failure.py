"""A disagreement for tests/test_trace.py: rank 0 asks for all_reduce of 10 elements, the
others of 20; every rank's error names the merged timeline of the ranks that failed."""
import numpy as np

import commlib

world = commlib.init()
try:
    world.all_reduce(np.ones(4))  # agreed on (a rank still finishing it may see the next)
    world.all_reduce(np.ones(10 if world.rank == 0 else 20))
except commlib.CollectiveMismatchError as e:
    notes = [n for n in getattr(e, "__notes__", []) if "last calls" in n]
    assert notes, e
    print(f"rank {world.rank}: {notes[0]}", flush=True)
else:
    raise AssertionError("no CollectiveMismatchError")
