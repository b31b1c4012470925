"""Socket helpers shared by the serve tests (a module, not a conftest: plain functions)."""

from __future__ import annotations

import socket
import time


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the peer closes `sock` within `seconds` (whatever it sends before is dropped)."""
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return False
