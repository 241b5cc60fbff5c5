"""A TCP proxy on 127.0.0.1 that delays every byte by a fixed time in each direction:
an object store as far away as S3 from another zone, for benchmarks (bench/store_latency.py).

Each direction of each connection has a reader thread and a sender thread: the reader
stamps each chunk with its arrival time, the sender forwards it `delay_s` later, in
order. The delay is a propagation delay, not a bandwidth cap: a second chunk read while
the first waits is not held back by it. A request and its answer thus cost 2 x
`delay_s` more, as on a real network; a new connection pays it once more for its
handshake's first data.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

# Read up to this much at a time: each chunk costs a queue handoff between two threads
# and a sleep; 1 MiB chunks cost the proxy ~25 % less CPU than 64 KiB ones (200 MB
# through it: 0.24 vs 0.33 s, sender and receiver included) at the same delay.
_CHUNK = 1 << 20


class LatencyProxy:
    def __init__(self, upstream: tuple[str, int], delay_s: float) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self.port = 0
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LatencyProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        listener.settimeout(0.2)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pipe(client, server)
            self._pipe(server, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        chunks: queue.Queue[tuple[float, bytes]] = queue.Queue()
        threading.Thread(target=self._read, args=(src, dst, chunks), daemon=True).start()
        threading.Thread(target=self._send, args=(src, dst, chunks), daemon=True).start()

    def _read(
        self, src: socket.socket, dst: socket.socket, chunks: queue.Queue[tuple[float, bytes]]
    ) -> None:
        while True:
            try:
                data = src.recv(_CHUNK)
            except OSError:
                data = b""
            chunks.put((time.monotonic() + self.delay_s, data))
            if not data:
                return

    def _send(
        self, src: socket.socket, dst: socket.socket, chunks: queue.Queue[tuple[float, bytes]]
    ) -> None:
        while True:
            due, data = chunks.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            try:
                dst.sendall(data)
            except OSError:
                with contextlib.suppress(OSError):
                    src.close()
                return
