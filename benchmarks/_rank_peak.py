"""One torchrun rank for start_memory.py: runs the engine as a child process and writes the child's
peak resident set (getrusage RUSAGE_CHILDREN: the largest waited-for descendant's VmHWM) to
$MEGATRAIN_PEAK_DIR/{RANK}.peak, in bytes. Measured outside the engine, exactly, with no polling."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

env = {k: v for k, v in os.environ.items() if k != "MEGATRAIN_PEAK_DIR"}
rc = subprocess.call([sys.executable, "-m", "megatrain.engine.train", *sys.argv[1:]], env=env)
peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
Path(os.environ["MEGATRAIN_PEAK_DIR"], f"{os.environ['RANK']}.peak").write_text(str(peak_kib * 1024))
sys.exit(rc)
