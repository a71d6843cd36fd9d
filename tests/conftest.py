import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests import the mpirun helper
sys.path.insert(0, str(Path(__file__).parent.parent))  # and the bench package
