"""An HTTP server on loopback for a test (a downstream, a collector): started in a daemon
thread, closed by :meth:`Loopback.close`."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Quiet(BaseHTTPRequestHandler):
    """A request handler that logs nothing (the suite's output stays the tests')."""

    def log_message(self, *args: Any) -> None:
        pass

    def answer(self, status: int = 200) -> None:
        """An empty answer with ``status``."""
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()


class Loopback:
    """``handler`` served on 127.0.0.1 at a free port; ``url`` ends with ``path``."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], path: str = "") -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
