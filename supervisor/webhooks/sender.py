"""One POST under a hard deadline: the whole attempt (connect, send, the response's
status line, headers and up to MAX_BODY of its body) ends within `timeout` seconds,
whatever the receiver does (trickles bytes, never answers, sends 30 MB).

The socket timeout bounds each wait, and a timer shuts the socket down at the deadline,
which bounds their sum. Redirects are answers, not followed (http.client follows none);
TLS is verified against the system's CAs with the host name checked. A new connection
per attempt: nothing of one receiver's state outlives its attempt. Errors are one safe
line each (never the URL, never the response's text).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Mapping

from derivd.webhooks.policy import Response

MAX_BODY = 64 * 1024
CONNECT_TIMEOUT_S = 5.0
_TLS = ssl.create_default_context()


class _Deadline:
    """Shuts the connection's socket down when the attempt's time is up."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float) -> None:
        self.conn = conn
        self.expired = False
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True

    def _expire(self) -> None:
        self.expired = True
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    connect_s = min(CONNECT_TIMEOUT_S, timeout)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(
            parts.hostname or "", parts.port, timeout=connect_s, context=_TLS
        )
    else:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=connect_s)
    return conn, path


def _read_capped(response: http.client.HTTPResponse) -> None:
    left = MAX_BODY
    while left > 0:
        chunk = response.read(min(left, 16384))
        if not chunk:
            return
        left -= len(chunk)


def post(url: str, body: bytes, headers: Mapping[str, str], *, timeout: float) -> Response:
    """POST `body`; the response's status (None: none came) and a safe error line."""
    conn, path = _connection(url, timeout)
    started = time.monotonic()
    deadline = _Deadline(conn, timeout)
    deadline.timer.start()
    try:
        conn.connect()
        if conn.sock is not None:
            conn.sock.settimeout(max(0.001, timeout - (time.monotonic() - started)))
        conn.request("POST", path, body=body, headers=dict(headers))
        response = conn.getresponse()
        status, retry_after = response.status, response.getheader("retry-after")
        with contextlib.suppress(OSError, http.client.HTTPException):
            _read_capped(response)  # the status is the answer; the body is only drained
        return Response(status, retry_after=retry_after)
    except TimeoutError:
        return Response(None, "timeout")
    except ssl.SSLCertVerificationError:
        return Response(None, "tls: certificate not trusted")
    except ssl.SSLError:
        return Response(None, "tls error")
    except ConnectionRefusedError:
        return Response(None, "connection refused")
    except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
        return Response(None, "timeout" if deadline.expired else "connection reset")
    except socket.gaierror:
        return Response(None, "host not found")
    except (OSError, http.client.HTTPException) as error:
        if deadline.expired:
            return Response(None, "timeout")
        return Response(None, f"network error: {type(error).__name__}")
    finally:
        deadline.timer.cancel()
        conn.close()
