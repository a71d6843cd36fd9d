"""Run by torchrun, not mpiexec: each process is alone in its MPI world, so the commlib
backend must refuse at once, saying to launch with mpiexec, through both ways in."""
import torch.distributed as dist

import commlib.torch_backend as tb

for name, start in (("helper", tb.init_process_group),
                    ("standard", lambda: dist.init_process_group("commlib"))):
    try:
        start()
    except RuntimeError as e:
        assert "mpiexec" in str(e), str(e)
        print(f"refused-{name}: {e}", flush=True)
    else:
        print(f"ACCEPTED-{name}", flush=True)
