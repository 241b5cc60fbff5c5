"""The supervisor's HTTP endpoint at `[metrics] listen`: Prometheus at `/metrics`, the
dashboard at `/`, nothing else.

Read-only by construction: GET and HEAD only, the query string is ignored, any other path
is a plain 404, and a page that fails to build is a plain 500 whose cause goes to the log
(never a traceback to the browser). Keep the address on a private interface: the
dashboard shows file ids and host names, and has no login.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

log = logging.getLogger("derivd.web")


@dataclass(frozen=True)
class Response:
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    status: int = 200


# A route answers from the request's headers, names in lower case (Prometheus negotiates
# its format from `accept`).
Route = Callable[[Mapping[str, str]], Response]

# No script, no external anything: inline styles and inline SVG only.
SECURITY_HEADERS = (
    ("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; img-src data:"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)

NOT_FOUND = Response(b"not found\n", status=404)
FAILED = Response(b"page unavailable: see the supervisor log\n", status=500)


class _Handler(BaseHTTPRequestHandler):
    routes: Mapping[str, Route] = {}
    server_version = "derivd"
    sys_version = ""
    timeout = 10  # a slow or idle client cannot hold a thread for long

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def _answer(self, *, head: bool) -> None:
        route = self.routes.get(urlsplit(self.path).path)
        response = NOT_FOUND if route is None else self._run(route)
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        for name, value in SECURITY_HEADERS:
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(response.body)

    def _run(self, route: Route) -> Response:
        try:
            return route({k.lower(): v for k, v in self.headers.items()})
        except Exception:
            log.exception("web: building %s failed", urlsplit(self.path).path)
            return FAILED

    def log_message(self, format: str, *args: object) -> None:
        log.debug("web: " + format, *args)


class WebServer:
    """A threaded HTTP server in a daemon thread of the supervisor (its loop never waits
    on a request)."""

    def __init__(self, host: str, port: int, routes: Mapping[str, Route]) -> None:
        handler = type("Handler", (_Handler,), {"routes": dict(routes)})
        server = type("Server", (_Server,), {"address_family": _family(host, port)})
        self.httpd = server((host, port), handler)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="derivd-web", daemon=True
        )
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def fileno(self) -> int:
        return int(self.httpd.socket.fileno())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def _family(host: str, port: int) -> socket.AddressFamily:
    """IPv4 or IPv6, as the host name resolves (like Prometheus' own server)."""
    return socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
