"""The connections of `nmt serve`: counted, capped (in all and per client address), closed when
idle or stalled, aborted when their client stops reading, and the requests aiohttp's HTTP parser
refuses answered in JSON."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from nmt_cli import ui


class Connections:
    """The service's protocol factory: every open connection, at most `limit` of them, each
    closed once it has had no request in progress for `idle` seconds (with a 408 if it had sent
    part of one).

    aiohttp bounds a body's read (we do, with read_timeout) and an idle keep-alive, but not a
    request head that never ends: its handler starts only once the head is whole. So idleness is
    counted from the connection's start or its last answer, and data arriving does not reset
    it. Each connection is aiohttp's own protocol behind a thin proxy that sees it open and close."""

    def __init__(self, limit: int, idle: float, write_timeout: float = 30.0, per_client: int = 0):
        self.limit, self.idle, self.write_timeout, self.per_client = limit, idle, write_timeout, per_client
        self.refusal = _raw_json(503, "Service Unavailable", "too many connections: retry shortly")
        self.clients: dict = {}  # client address -> its open connections
        self.late = _raw_json(408, "Request Timeout", f"the request's head did not arrive within {idle:g} s")
        # aiohttp's protocol factory (AppRunner.server), once set up
        self.factory: Callable[[], asyncio.Protocol] | None = None
        self.open: dict = {}  # transport -> its _Connection

    def __call__(self) -> asyncio.Protocol:
        return _Connection(self)

    def started(self, transport) -> None:
        """A request's head has arrived (its handler runs)."""
        if transport in self.open:
            self.open[transport].busy += 1

    def finished(self, transport) -> None:
        if transport in self.open:
            connection = self.open[transport]
            connection.busy -= 1
            connection.since, connection.partial = time.monotonic(), False

    async def watch(self) -> None:
        """Close the connections idle too long, and abort those whose client has not read what
        was written to it for `write_timeout` seconds (a closed connection waits for its answer
        to drain, so a client that never reads would hold its slot for ever). Four times a
        second, or per `idle`."""
        while True:
            await asyncio.sleep(min(0.25, self.idle / 4, self.write_timeout / 4))
            now = time.monotonic()
            for transport, connection in list(self.open.items()):
                stalled = connection.stalled_since
                if stalled is not None and stalled < now - self.write_timeout:
                    transport.abort()
                elif not connection.busy and connection.since < now - self.idle:
                    if transport.get_write_buffer_size():  # an answer still unread after `idle`
                        transport.abort()
                        continue
                    if connection.partial:
                        transport.write(self.late)
                    transport.close()


class _Connection(asyncio.Protocol):
    def __init__(self, connections: Connections):
        self.connections, self.transport = connections, None
        self.inner: asyncio.Protocol | None = None
        self.busy, self.since = 0, time.monotonic()
        self.partial = False  # bytes arrived since the last answer
        self.stalled_since: float | None = None  # writing paused: the client does not read
        self.client = None

    def connection_made(self, transport) -> None:
        c = self.connections
        peer = transport.get_extra_info("peername")
        self.client = peer[0] if isinstance(peer, tuple) else peer
        if len(c.open) >= c.limit or (c.per_client and c.clients.get(self.client, 0) >= c.per_client):
            transport.write(c.refusal)
            transport.close()
            return
        self.transport = transport
        c.open[transport] = self
        c.clients[self.client] = c.clients.get(self.client, 0) + 1
        assert c.factory is not None, "the server is set up before it accepts"
        self.inner = c.factory()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.partial = True
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc) -> None:
        if self.connections.open.pop(self.transport, None) is not None:
            left = self.connections.clients.pop(self.client) - 1
            if left:
                self.connections.clients[self.client] = left
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.stalled_since = time.monotonic()
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.stalled_since = None
        if self.inner is not None:
            self.inner.resume_writing()


def _raw_json(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP response with a JSON error, for a connection no handler serves."""
    body = json.dumps({"error": message}).encode()
    return (
        b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n%s\r\n%s"
        % (status, reason.encode(), len(body), b"Retry-After: 1\r\n" if status == 503 else b"", body)
    )


def with_json_errors(server):
    """aiohttp's protocol factory `server`, its protocols answering the requests its HTTP parser
    refuses (malformed request lines and headers, before any handler or middleware) with a JSON
    error too, and logging each in one line instead of a traceback."""
    from http import HTTPStatus

    from aiohttp import web, web_protocol

    class JsonErrors(web_protocol.RequestHandler):
        __slots__ = ()  # the same layout: an instance of aiohttp's class can become one

        def handle_error(self, request, status=500, exc=None, message=None):
            super().handle_error(request, status, exc, message)  # its checks and its log line
            what = getattr(exc, "message", None) or exc or HTTPStatus(status).phrase
            text = " ".join(str(what).split())
            response = web.json_response({"error": text[:300]}, status=status)
            response.force_close()
            return response

    log = logging.getLogger("aiohttp.server")
    log.handlers[:] = [_OneLine()]
    log.propagate = False

    def factory():
        protocol = server()
        protocol.__class__ = JsonErrors
        return protocol

    return factory


class _OneLine(logging.Handler):
    """A log record as one line on stderr: its message and its exception's, no traceback; at
    most `burst` lines per `window` seconds, then one line counting those left out (a client
    sending malformed requests in a loop must not fill the operator's disk)."""

    def __init__(self, burst: int = 20, window: float = 60.0):
        super().__init__()
        self.burst, self.window = burst, window
        self.started, self.shown, self.dropped = -window, 0, 0

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic()
        if now - self.started >= self.window:
            if self.dropped:
                ui.say(f"({self.dropped} more lines like these left out)")
            self.started, self.shown, self.dropped = now, 0, 0
        if self.shown >= self.burst:
            self.dropped += 1
            return
        self.shown += 1
        exc = record.exc_info[1] if record.exc_info else None
        detail = f": {type(exc).__name__}: {' '.join(str(exc).split())[:300]}" if exc else ""
        ui.say(f"{record.getMessage()}{detail}")


def connection_limit(wanted: int) -> int:
    """`wanted`, or fewer where the process may not open that many files (each connection is
    one; a margin is kept for the model's files and the listening socket)."""
    import resource

    margin = 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted + margin:
        soft = wanted + margin if hard == resource.RLIM_INFINITY else min(hard, wanted + margin)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < wanted + margin:
        ui.say(f"--max-connections {wanted} lowered to {soft - margin}: the open-file limit is {soft}")
        return max(1, soft - margin)
    return wanted
