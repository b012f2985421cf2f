"""Named points where tests kill a run, to prove that rerunning the same command loses nothing.

`HEADWAY_KILL_AT=checkpoint:3` sends SIGKILL to this process right after the step-3 checkpoint is
written. Unset (always, outside tests) it does nothing.
"""

from __future__ import annotations

import os
import signal


def fault_point(name: str) -> None:
    if os.environ.get("HEADWAY_KILL_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
