"""An HTTP server on loopback for a test (a downstream, a collector): started in a daemon
thread, closed by :meth:`Loopback.close`. The suite's downstream stand-ins (the recorders
of tests/test_forward_*.py, test_route_*.py and test_worker_*.py) are each a :class:`Quiet`
handler served by one :class:`Loopback`: what they answer and record is their own."""

from __future__ import annotations

import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Quiet(BaseHTTPRequestHandler):
    """A request handler that logs nothing (the suite's output stays the tests')."""

    def log_message(self, *args: Any) -> None:
        pass

    def body(self) -> bytes:
        """The request's body (its content-length's bytes)."""
        return self.rfile.read(int(self.headers["content-length"]))

    def answer(self, status: int = 200) -> None:
        """An empty answer with ``status``."""
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()


class Loopback:
    """``handler`` served on 127.0.0.1 at a free port; ``url`` ends with ``path``.

    ``tls``: served over TLS with that context (set up before the first connection);
    ``backlog``: the listen queue (the default, 5, drops connections when every slot of
    two workers connects at once, and a client's SYN retry takes a second);
    ``daemon_threads=False``: :meth:`close` waits for the requests being answered."""

    def __init__(
        self,
        handler: type[BaseHTTPRequestHandler],
        path: str = "",
        *,
        tls: ssl.SSLContext | None = None,
        backlog: int | None = None,
        daemon_threads: bool = True,
    ) -> None:
        server_class = ThreadingHTTPServer
        if backlog is not None:
            server_class = type("Server", (ThreadingHTTPServer,), {"request_queue_size": backlog})
        self.httpd = server_class(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = daemon_threads
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}{path}"
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
