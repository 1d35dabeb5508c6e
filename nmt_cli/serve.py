"""`nmt serve`: an HTTP JSON service over an exported model, on aiohttp.

    POST /translate {"text": ["...", ...], "beam": 4, "nbest": 1}
      -> {"translations": ["...", ...]}                  (nbest > 1: lists of {"text", "score"})
    GET /health -> {"status": "ok", ...}

Requests that arrive within `max_wait_ms` of each other are decoded together (dynamic
batching), up to `max_batch` sentences at the default beam, by one decoding thread; the event
loop only parses, checks and answers. A large request is decoded in pieces, and each batch
serves first the requests served least so far, so a short request waits for at most about one
batch whatever is queued; one request may ask for `max_hypotheses` (sentences x beam) at most.
Past `max_queue` waiting sentences a request gets 503 with Retry-After.
Every refusal is a 4xx/5xx JSON {"error": "..."}; nothing a client sends reaches a traceback.
A request whose client goes away, or that is not answered within `request_timeout` (504), leaves
the queue (a batch already being decoded finishes); a batch that fails is decoded again request
by request, so only the request that fails gets the error. /health says whether the decoding
loop runs. A connection with no request in progress is closed after `header_timeout` (408 if it
sent part of one), so a request's head must arrive whole within it (a client sending half a head
and waiting, slowloris, holds nothing); past `max_connections` open, a new one gets 503.
SIGTERM or SIGINT: stop accepting, answer what is in flight, exit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from nmt_cli import ui
from nmt_cli.config import ServeConfig, TranslateConfig
from nmt_cli.errors import NmtError
from nmt_cli.package import Model
from nmt_cli.translate import Translator

MAX_BEAM = 32


def require():
    try:
        from aiohttp import web
    except ImportError:
        raise NmtError(
            "aiohttp is not installed: pip install 'nmt-cli[serve]' (or pip install aiohttp)"
        ) from None
    return web


@dataclass(eq=False)  # a job is itself: the queue finds and removes it by identity
class Job:
    sentences: list[str]
    beam: int
    nbest: int
    done: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)
    taken: int = 0  # sentences handed to the decoder so far
    answers: list = field(default_factory=list)  # the answers of the pieces decoded, in order


Piece = tuple[Job, int, int]  # a job's sentences [lo, hi) in one decoding batch


class Batcher:
    """Gathers the sentences of concurrent requests into decoding batches, the requests served
    least first, large ones in pieces."""

    def __init__(self, translator: Translator, config: ServeConfig):
        self.translator, self.config = translator, config
        self.jobs: deque[Job] = deque()
        self.pending = 0  # sentences queued or being decoded
        self.arrived = asyncio.Event()
        self.decoder = ThreadPoolExecutor(1, thread_name_prefix="nmt-decode")

    def submit(self, sentences: list[str], beam: int, nbest: int) -> asyncio.Future | None:
        """The future of the job's answer, or None when the queue is full."""
        if self.pending + len(sentences) > self.config.max_queue:
            return None
        job = Job(sentences, beam, nbest, asyncio.get_running_loop().create_future())
        self.jobs.append(job)
        self.pending += len(sentences)
        self.arrived.set()
        return job.done

    def withdraw(self, done: asyncio.Future) -> None:
        """The job of `done` leaves the queue undecoded (its client went away); a piece of it that
        is being decoded finishes, unanswered."""
        done.cancel()
        for job in self.jobs:
            if job.done is done:
                self.jobs.remove(job)
                self.pending -= len(job.sentences) - job.taken
                return

    def _next(self) -> Job:
        """The job served least so far (then the oldest): a short request waits for at most the
        batch being decoded, however large the requests queued before it."""
        return min(self.jobs, key=lambda j: (j.taken, j.arrived))

    def _take(self) -> list[Piece]:
        """One decoding batch: pieces of the jobs with the next job's settings, least served
        first, up to `max_batch` sentences at the default beam (fewer at a wider beam, so that
        every batch is about as much work)."""
        first = self._next()
        budget = self.config.max_batch * self.translator.config.beam  # hypotheses
        pieces: list[Piece] = []
        same = [j for j in self.jobs if (j.beam, j.nbest) == (first.beam, first.nbest)]
        for job in sorted(same, key=lambda j: (j.taken, j.arrived)):
            if pieces and (not self.config.batching or budget < job.beam):
                break
            n = min(len(job.sentences) - job.taken, max(1, budget // job.beam))
            pieces.append((job, job.taken, job.taken + n))
            job.taken += n
            budget -= n * job.beam
            if job.taken == len(job.sentences):
                self.jobs.remove(job)
        return pieces

    def _ready(self) -> bool:
        waited = time.monotonic() - self._next().arrived
        queued = sum(len(j.sentences) - j.taken for j in self.jobs)
        return (
            not self.config.batching
            or queued >= self.config.max_batch
            or waited * 1000 >= self.config.max_wait_ms
        )

    async def run(self) -> None:
        while True:
            while not self.jobs:
                self.arrived.clear()
                await self.arrived.wait()
            while self.jobs and not self._ready():
                self.arrived.clear()
                left = self.config.max_wait_ms / 1000 - (time.monotonic() - self._next().arrived)
                try:
                    await asyncio.wait_for(self.arrived.wait(), timeout=max(left, 0.0))
                except asyncio.TimeoutError:
                    pass
            if not self.jobs:
                continue
            pieces = self._take()
            try:
                await self._serve(pieces)
            finally:
                self.pending -= sum(hi - lo for _, lo, hi in pieces)

    async def _serve(self, pieces: list[Piece]) -> None:
        """Decode `pieces` as one batch and answer each job whose last piece this is; if the
        batch fails, each piece alone (a job whose piece fails gets the error and leaves). Jobs
        nobody waits for any more (client gone, deadline passed) are not decoded."""
        pieces = [p for p in pieces if not p[0].done.done()]
        if not pieces:
            return
        loop = asyncio.get_running_loop()
        sentences = [s for job, lo, hi in pieces for s in job.sentences[lo:hi]]
        first = pieces[0][0]
        try:
            texts, hyps = await loop.run_in_executor(
                self.decoder, self._decode, sentences, first.beam, first.nbest
            )
        except Exception as e:  # noqa: BLE001 - a request the decoder fails on fails alone
            if len(pieces) > 1:
                for piece in pieces:
                    await self._serve([piece])
            else:
                job = pieces[0][0]
                job.done.set_exception(e)
                if job in self.jobs:  # its other pieces are not decoded
                    self.jobs.remove(job)
                    self.pending -= len(job.sentences) - job.taken
            return
        start = 0
        for job, lo, hi in pieces:
            end = start + hi - lo
            job.answers += _answer(texts[start:end], hyps[start:end], job.nbest)
            if len(job.answers) == len(job.sentences) and not job.done.done():
                job.done.set_result(job.answers)
            start = end

    def _decode(self, sentences: list[str], beam: int, nbest: int):
        hyps = self.translator.hypotheses(sentences, beam, nbest)
        return self.translator.texts(hyps), hyps


class Connections:
    """The service's protocol factory: every open connection, at most `limit` of them, each
    closed once it has had no request in progress for `idle` seconds (with a 408 if it had sent
    part of one).

    aiohttp bounds a body's read (we do, with read_timeout) and an idle keep-alive, but not a
    request head that never ends: its handler starts only once the head is whole. So idleness is
    counted from the connection's start or its last answer, and data arriving does not reset
    it. Each connection is aiohttp's own protocol behind a thin proxy that sees it open and close."""

    def __init__(self, limit: int, idle: float):
        self.limit, self.idle = limit, idle
        self.refusal = _raw_json(503, "Service Unavailable", "too many connections: retry shortly")
        self.late = _raw_json(408, "Request Timeout", f"the request's head did not arrive within {idle:g} s")
        self.factory = None  # aiohttp's protocol factory (AppRunner.server), once set up
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
        """Close the connections idle too long, checking four times a second (or per `idle`)."""
        while True:
            await asyncio.sleep(min(0.25, self.idle / 4))
            late = time.monotonic() - self.idle
            for transport, connection in list(self.open.items()):
                if not connection.busy and connection.since < late:
                    if connection.partial:
                        transport.write(self.late)
                    transport.close()


class _Connection(asyncio.Protocol):
    def __init__(self, connections: Connections):
        self.connections, self.inner, self.transport = connections, None, None
        self.busy, self.since = 0, time.monotonic()
        self.partial = False  # bytes arrived since the last answer

    def connection_made(self, transport) -> None:
        if len(self.connections.open) >= self.connections.limit:
            transport.write(self.connections.refusal)
            transport.close()
            return
        self.transport = transport
        self.connections.open[transport] = self
        self.inner = self.connections.factory()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.partial = True
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc) -> None:
        self.connections.open.pop(self.transport, None)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
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


def _answer(texts: list[list[str]], hyps, nbest: int) -> list:
    if nbest == 1:
        return [t[0] for t in texts]
    return [[{"text": t, "score": round(h.score, 4)} for t, h in zip(ts, hs)] for ts, hs in zip(texts, hyps)]


def error(web, status: int, message: str, **headers: str):
    return web.json_response({"error": message}, status=status, headers=headers or None)


def parse(body: bytes, config: ServeConfig, default_beam: int) -> tuple[list[str], int, int]:
    """The request's sentences, beam and nbest; ValueError (400) or OverflowError (413)."""
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("the body is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the body is not JSON ({e})") from None
    except RecursionError:  # thousands of nested brackets: the parser recurses once per level
        raise ValueError("the body is JSON nested too deeply") from None
    if not isinstance(data, dict) or "text" not in data:
        raise ValueError('expected a JSON object {"text": ["sentence", ...]}')
    unknown = set(data) - {"text", "beam", "nbest"}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    text = data["text"]
    if not isinstance(text, list) or not all(isinstance(s, str) for s in text):
        raise ValueError('"text" must be a list of strings')
    if not text:
        raise ValueError('"text" is empty')
    if len(text) > config.max_sentences:
        raise OverflowError(f"{len(text)} sentences in one request; the limit is {config.max_sentences}")
    for i, s in enumerate(text):
        if len(s) > config.max_chars:
            raise ValueError(f"sentence {i} has {len(s)} characters; the limit is {config.max_chars}")
    beam, nbest = data.get("beam", default_beam), data.get("nbest", 1)
    for name, value in (("beam", beam), ("nbest", nbest)):
        if type(value) is not int or not 1 <= value <= MAX_BEAM:
            raise ValueError(f'"{name}" must be an integer from 1 to {MAX_BEAM}')
    if nbest > beam:
        raise ValueError(f'"nbest" ({nbest}) exceeds "beam" ({beam})')
    if len(text) * beam > config.max_hypotheses:
        raise OverflowError(
            f"{len(text)} sentences at beam {beam} are {len(text) * beam} hypotheses; the limit is "
            f"{config.max_hypotheses} (--max-hypotheses): send fewer sentences or a narrower beam"
        )
    return text, beam, nbest


def make_app(
    translator: Translator, model: Model, config: ServeConfig, connections: Connections | None = None
):
    web = require()
    app = web.Application(client_max_size=config.max_body)
    batcher_key = web.AppKey("batcher", Batcher)
    loop_key = web.AppKey("decoding_loop", asyncio.Task)

    async def translate(request):
        if request.headers.get("Content-Encoding", "identity").lower() != "identity":
            # Nothing is decompressed: a small compressed body can expand to gigabytes.
            return error(web, 415, "compressed request bodies are not accepted: send plain JSON")
        try:
            body = await asyncio.wait_for(request.read(), config.read_timeout)
        except web.HTTPRequestEntityTooLarge:
            return error(web, 413, f"the body exceeds {config.max_body} bytes")
        except asyncio.TimeoutError:  # it promised more than it sends: the connection is not kept
            response = error(web, 408, f"the body did not arrive within {config.read_timeout:g} s")
            response.force_close()
            return response
        try:
            text, beam, nbest = parse(body, config, translator.config.beam)
        except OverflowError as e:
            return error(web, 413, str(e))
        except ValueError as e:
            return error(web, 400, str(e))
        done = request.app[batcher_key].submit(text, beam, nbest)
        if done is None:
            return error(web, 503, "the queue is full: retry shortly", **{"Retry-After": "1"})
        try:
            translations = await asyncio.wait_for(asyncio.shield(done), config.request_timeout)
            return web.json_response({"translations": translations})
        except asyncio.TimeoutError:  # past its deadline: it leaves the queue, the client is told
            request.app[batcher_key].withdraw(done)
            return error(web, 504, f"not answered within {config.request_timeout:g} s (--request-timeout)")
        except asyncio.CancelledError:  # the client went away: its sentences leave the queue
            request.app[batcher_key].withdraw(done)
            raise
        except Exception as e:  # noqa: BLE001 - a decoding failure: the service lives on
            return error(web, 500, f"{type(e).__name__}: {e}")

    async def health(request):
        alive = not request.app[loop_key].done()
        return web.json_response(
            {
                "status": "ok" if alive else "the decoding loop has stopped",
                "model": str(model.where),
                "engine": translator.engine,
                "queued": request.app[batcher_key].pending,
            },
            status=200 if alive else 503,
        )

    async def not_allowed(request):
        return error(web, 405, f"{request.method} {request.path} is not served: POST /translate, GET /health")

    @web.middleware
    async def json_errors(request, handler):  # aiohttp's own 404/405 pages as JSON too
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error(web, e.status, e.reason)

    async def batching(app):
        batcher = app[batcher_key] = Batcher(translator, config)
        task = app[loop_key] = asyncio.get_running_loop().create_task(batcher.run())
        yield
        task.cancel()
        batcher.decoder.shutdown(wait=True)

    @web.middleware
    async def in_progress(request, handler):  # a connection with a request running is not idle
        connections.started(request.transport)
        try:
            return await handler(request)
        finally:
            connections.finished(request.transport)

    app.middlewares.append(json_errors)
    if connections is not None:
        app.middlewares.append(in_progress)
    app.cleanup_ctx.append(batching)
    app.router.add_post("/translate", translate)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/translate", not_allowed)
    return app


def run(model: Model, translate_config: TranslateConfig, config: ServeConfig) -> None:
    web = require()
    translator = Translator(model, translate_config)
    connections = Connections(_connection_limit(config.max_connections), config.header_timeout)
    app = make_app(translator, model, config, connections)

    async def main() -> None:
        # handler_cancellation: a request whose client disconnects is cancelled, so that it
        # leaves the decoding queue (aiohttp's default since 3.9 lets it run on). lingering_time:
        # after answering a request whose body was not read whole, aiohttp reads on for this long
        # before closing (10 s by default), so a client still sending sees the answer, not a
        # reset; a client that stalls would keep its connection that long.
        runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=config.shutdown_timeout,
            handler_cancellation=True,
            lingering_time=1.0,
        )
        await runner.setup()
        connections.factory = _json_errors(runner.server)
        loop = asyncio.get_running_loop()
        try:  # not web.TCPSite: it would hand connections to aiohttp's protocol unwatched
            server = await loop.create_server(connections, config.host, config.port, reuse_address=True)
        except OSError as e:
            await runner.cleanup()
            raise NmtError(f"cannot listen on {config.host}:{config.port}: {e.strerror}") from None
        watch = loop.create_task(connections.watch())
        host, port = server.sockets[0].getsockname()[:2]
        ui.say(f"serving {model.where} ({translator.engine}) on http://{host}:{port}")
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        ui.say("stopping: no new connections; answering the requests in flight")
        server.close()
        await runner.cleanup()  # answers the requests in flight, then closes their connections
        watch.cancel()
        ui.say("stopped")

    asyncio.run(main())


def _json_errors(server):
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
    """A log record as one line on stderr: its message and its exception's, no traceback."""

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        detail = f": {type(exc).__name__}: {' '.join(str(exc).split())[:300]}" if exc else ""
        ui.say(f"{record.getMessage()}{detail}")


def _connection_limit(wanted: int) -> int:
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
