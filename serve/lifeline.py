"""A training child's lifeline to the server that started it (``serve/training.py``): the child ends when the server
does, however the server ends, ``SIGKILL`` included.

The server starts the child with its stdin a pipe whose write end only the server holds, and never writes to it, and
with ``LIFELINE_ENV`` set. ``exit_with_server()``, called first thing in the child, watches that pipe from a thread:
once the server's process is gone, the read returns end-of-file and the child exits. Light on purpose (no torch):
the lifeline holds from the child's first second.
"""

from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["LIFELINE_ENV", "exit_with_server"]

LIFELINE_ENV = "TOOLTRIE_TRAINING_LIFELINE"


def exit_with_server() -> None:
    """End this process at once when the server that started it is gone; a no-op in a process started otherwise
    (by hand, without ``LIFELINE_ENV``)."""
    if os.environ.get(LIFELINE_ENV) != "stdin":
        return

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os._exit(1)  # nothing to clean up: the adapter is written atomically, the work directory is scratch

    threading.Thread(target=watch, name="tooltrie-server-lifeline", daemon=True).start()
