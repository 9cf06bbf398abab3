"""The HTTP server ingress runs (uvicorn, h11), with the limits uvicorn does not keep itself.

- A connection must send a request's headers within ``header_timeout_s`` of opening (or of its
  previous response); one that dawdles (a slow-loris client) is closed, so idle sockets cannot
  pile up until the process runs out of file descriptors.
- Signals stay with the stage: it drains in-flight requests before the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeaderDeadline(H11Protocol):
    """h11 with a deadline for each request's headers."""

    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # a request's headers are in: its body and answer take what they take

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets the same deadline

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


class HttpServer(uvicorn.Server):
    """uvicorn without its signal handlers (the stage owns SIGTERM/SIGINT)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT, which other processes bind too: the
    kernel spreads new connections among them (several ingress replicas behind one port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def http_server(app, host: str, port: int, header_timeout_s: float) -> HttpServer:
    protocol = type("HeaderDeadlineProtocol", (_HeaderDeadline,), {"header_timeout_s": header_timeout_s})
    # log_config=None: uvicorn's records go to the root logger, rendered as every other line (pdflow.log)
    config = uvicorn.Config(app, host=host, port=port, loop="none", lifespan="off", log_level="warning",
                            log_config=None, timeout_graceful_shutdown=1, http=protocol, ws="none")
    return HttpServer(config)
