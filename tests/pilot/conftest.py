import sys
from pathlib import Path

# the experiment-only pilot (tools/pilot_lab.py) is not part of the installed package
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
