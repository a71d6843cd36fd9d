"""PyTorch's own backend suite (the tests gloo and NCCL run) on commlib, side by side with
gloo, at world sizes 2, 3 and 4 (tests/conformance/run.py): every test gloo passes must pass
on commlib, as a plugin or with the suite's gates on gloo's name lifted, apart from what
torch's own library code restricts to gloo (run.KNOWN). Opt-in, being long:
``python -m pytest -m conformance``."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch's test utilities need it

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.conformance
@pytest.mark.parametrize("n", [2, 3, 4])
def test_pytorch_backend_suite_passes_what_gloo_passes(n):
    run = subprocess.run([sys.executable, str(ROOT / "tests/conformance/run.py"),
                          "--world-sizes", str(n)], cwd=ROOT, capture_output=True, text=True,
                         timeout=3600)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
