"""The real engine (`megatrain.engine.train`) whose checkpoint save of step SLOW_SAVE_STEP stalls
before its manifest is written, having written SLOW_SAVE_MARKER: a save caught in flight."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from megatrain.engine.checkpoint import sharded
from megatrain.engine.train import main

_finish = sharded.finish_folder


def _slow_finish(root: Any, step: int, *args: Any) -> Any:
    if step == int(os.environ["SLOW_SAVE_STEP"]):
        Path(os.environ["SLOW_SAVE_MARKER"]).write_text(str(step))
        time.sleep(120)  # the data files are written; the manifest is not, until this returns
    return _finish(root, step, *args)


sharded.finish_folder = _slow_finish

if __name__ == "__main__":
    sys.exit(main())
