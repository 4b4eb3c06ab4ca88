"""Whether a process of this host still runs (for cleaning up what a dead one left behind)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True when process ``pid`` exists on this host (including another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
