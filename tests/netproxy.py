"""A TCP proxy the tests can cut: makes 'Postgres unreachable' real without stopping Postgres.

:meth:`CuttableProxy.cut` resets every connection and refuses new ones (a server that is
gone); :meth:`CuttableProxy.hold` keeps every connection open and forwards nothing until
:meth:`CuttableProxy.release` (a partition: no reset, no answer, bytes held until it heals)."""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttableProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = int(self.listener.getsockname()[1])
        self._open = threading.Event()
        self._open.set()
        self._flowing = threading.Event()
        self._flowing.set()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self._open.is_set():
                client.close()
                continue
            self._flowing.wait()  # held: the connection is made once the partition heals
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                # cut() clears the flag before it takes the lock: a connection accepted while
                # it ran is closed here, not kept alive past the cut.
                cut = not self._open.is_set()
                if not cut:
                    self._socks += [client, upstream]
            if cut:
                client.close()
                upstream.close()
                continue
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                self._flowing.wait()
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Refuse new connections and reset the existing ones."""
        self._open.clear()
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restore(self) -> None:
        self._open.set()

    def hold(self) -> None:
        """Forward nothing, reset nothing: every byte waits, as across a partition."""
        self._flowing.clear()

    def release(self) -> None:
        """The partition heals: what was held flows on."""
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self.release()
        self.cut()
        self.listener.close()
