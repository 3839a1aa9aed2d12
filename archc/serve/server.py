"""uvicorn on a socket bound before anything else: the command's foreground server, and a
thread for tests and benchmarks."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from archc.errors import ArchcError


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, listening: bound before the model loads, so that an address
    in use is said at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ArchcError(f"--host {host}: not an address this machine can listen on "
                         f"({err.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise ArchcError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.listen(128)
    return sock


class Server:
    """uvicorn serving `app` on an already bound socket: `run` in the foreground (the command),
    or `start` in a thread and `stop` (tests, benchmarks)."""

    def __init__(self, app: Any, sock: socket.socket, *, log_level: str = "info") -> None:
        import uvicorn
        self.sock = sock
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level,
                                                    timeout_graceful_shutdown=5))
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self) -> Server:
        self.thread = threading.Thread(target=self.run, name="archc-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ArchcError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
        self.sock.close()
