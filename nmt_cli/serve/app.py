"""`nmt serve`: an HTTP JSON service over an exported model, on aiohttp.

    POST /translate {"text": ["...", ...], "beam": 4, "nbest": 1}
      -> {"translations": ["...", ...]}                  (nbest > 1: lists of {"text", "score"})
    GET /health -> {"status": "ok", ...}

Requests that arrive within `max_wait_ms` of each other are decoded together (dynamic
batching), up to `max_batch` sentences at the default beam, in decoding threads; the event loop
only parses, checks and answers. On nmt's engine on a CPU a request joins a running batch of
its options at its next decoding step, and running batches of different options take their
steps in turn (batcher.py), so a short request is not held up by a long one. One request may
ask for `max_hypotheses` (sentences x beam) at most, a beam of `max_beam`, and
`max_output_len` tokens per sentence at most (also its min_len and max_len_b); each
sentence's search must fit `max_memory`. Every decoding option is checked against
its range (config.translation.RANGES) as on the command line; NaN and infinities are refused.
The queue counts work: a sentence's hypotheses times its output limit in tokens (what its length,
prefix, constraints and max_len allow; a blank line nothing). Past `max_queue` typical sentences'
work (of 32 pieces, at the default options) a request gets 503 with Retry-After; one that is more
work than that alone gets 413. Requests that differ only in seed or alpha share batches.
Every refusal is a 4xx/5xx JSON {"error": "..."}; nothing a client sends reaches a traceback.
A request whose client goes away, or that is not answered within `request_timeout` (504), leaves
the queue (a batch already being decoded finishes); a batch that fails is decoded again request
by request, so only the request that fails gets the error. /health says whether the decoding
loop runs. A connection with no request in progress is closed after `header_timeout` (408 if it
sent part of one), so a request's head must arrive whole within it (a client sending half a head
and waiting, slowloris, holds nothing); past `max_connections` open, a new one gets 503.
A client that leaves its answer unread is cut off after `write_timeout`. On a loopback address
a request's Host must be loopback, and a POST must be application/json (what a browser page
cannot send unasked); `api_key` guards /translate.
SIGTERM or SIGINT: stop accepting, answer what is in flight, exit; a second signal: exit at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from nmt_cli import floors, ui
from nmt_cli.config import ServeConfig, TranslateConfig
from nmt_cli.errors import NmtError
from nmt_cli.inference.backend import Choice
from nmt_cli.inference.models import Model
from nmt_cli.serve.batcher import Batcher
from nmt_cli.serve.connections import Connections, connection_limit, with_json_errors
from nmt_cli.serve.contract import Served
from nmt_cli.serve.requests import parse


def require():
    floors.require("aiohttp", "aiohttp", floors.AIOHTTP, "serve")
    from aiohttp import web

    return web


# a refused request's answer waits this many times what parsing and counting it cost
REFUSAL_WAIT = 10


def error(web, status: int, message: str, **headers: str):
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _translate_route(web, translator: Served, config: ServeConfig, batcher_key):
    """POST /translate: read, check, queue, answer, each failure its own status."""

    async def refused(status: int, message: str, began: float):
        # Reading, parsing and counting a body cost the event loop, which every request shares: a
        # client looping bodies that are refused would take most of it. Its refusal comes after
        # REFUSAL_WAIT times what its body cost (a second at most), and a client sends one
        # request at a time per connection (whose number per address is capped), so such
        # clients take a bounded share of the loop.
        await asyncio.sleep(min(REFUSAL_WAIT * (time.perf_counter() - began), 1.0))
        return error(web, status, message)

    async def translate(request):
        began = time.perf_counter()  # what reading, parsing and counting the body cost
        if request.headers.get("Content-Encoding", "identity").lower() != "identity":
            # Nothing is decompressed: a small compressed body can expand to gigabytes.
            return error(web, 415, "compressed request bodies are not accepted: send plain JSON")
        if (request.content_length or 0) > config.max_body:  # refused unread, as its head says
            return error(web, 413, f"the body exceeds {config.max_body} bytes (--max-body)")
        try:
            body = await asyncio.wait_for(request.read(), config.read_timeout)
        except web.HTTPRequestEntityTooLarge:
            return error(web, 413, f"the body exceeds {config.max_body} bytes (--max-body)")
        except asyncio.TimeoutError:  # it promised more than it sends: the connection is not kept
            response = error(web, 408, f"the body did not arrive within {config.read_timeout:g} s")
            response.force_close()
            return response
        try:
            asked = parse(
                body,
                config,
                translator.config.decode,
                translator.tags,
                translator.choice,
                translator.max_src,
                tuple(translator.languages.ids) if translator.languages else (),
                translator.many_targets(),
            )
        except OverflowError as e:
            return await refused(413, str(e), began)
        except ValueError as e:
            return await refused(400, str(e), began)
        try:
            done = request.app[batcher_key].submit(
                asked.text, asked.options, asked.prefixes, asked.constraints
            )
        except OverflowError as e:  # more work than the whole queue holds: it would never fit
            return await refused(413, str(e), began)
        except RuntimeError as e:  # the decoding loop has stopped: nothing would answer
            return error(web, 503, str(e))
        if done is None:
            return error(web, 503, "the queue is full: retry shortly", **{"Retry-After": "1"})
        try:
            translations = await asyncio.wait_for(asyncio.shield(done), config.request_timeout)
            # strict JSON: a NaN or an infinity would be an answer that strict parsers reject
            return web.json_response({"translations": translations}, dumps=_strict_json)
        except asyncio.TimeoutError:  # past its deadline: it leaves the queue, the client is told
            request.app[batcher_key].withdraw(done)
            return error(web, 504, f"not answered within {config.request_timeout:g} s (--request-timeout)")
        except asyncio.CancelledError:  # the client went away: its sentences leave the queue
            request.app[batcher_key].withdraw(done)
            raise
        except Exception as e:  # noqa: BLE001 - a decoding failure: the service lives on
            # the client learns that it failed; what failed (paths, internals) stays in the log
            ui.say(f"nmt serve: a request failed: {type(e).__name__}: {e}")
            return error(web, 500, "decoding this request failed; the server's log says why")

    return translate


def _guard(web, config: ServeConfig):
    """What a request must carry before anything else is looked at. On a loopback address, a
    loopback Host: a page in the operator's browser may reach 127.0.0.1 under a name of its own
    (DNS rebinding). A POST's Content-Type application/json: a browser sends another type from any
    page without asking the server first (a CORS "simple request"), never this one. With
    --api-key, the key on every route but /health."""
    import hmac

    expected = config.api_key.encode()
    local = _loopback(config.host)  # the address is fixed: read it once, not per request

    @web.middleware
    async def guard(request, handler):
        if local and not _loopback(_hostname(request.headers.get("Host", ""))):
            return error(web, 403, "the Host header does not name this server's loopback address")
        if request.method == "POST" and request.content_type != "application/json":
            return error(web, 415, "send the request with Content-Type: application/json")
        # every route but /health: a decoding route added later is guarded without a word
        if config.api_key and request.path != "/health":
            # the scheme's name in any case (RFC 9110: "bearer" is "Bearer"), the key exactly
            scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
            key = given.strip().encode()
            if scheme.lower() != "bearer" or not hmac.compare_digest(key, expected):
                return error(web, 401, "a valid API key is required", **{"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return guard


def _hostname(host: str) -> str:
    """The name in a Host header: "127.0.0.1:8080" -> 127.0.0.1, "[::1]:8080" -> ::1."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _strict_json(data) -> str:
    return json.dumps(data, allow_nan=False)


def make_app(
    translator: Served,
    model: Model,
    config: ServeConfig,
    connections: Connections | None = None,
    on_loop_end: Callable[[asyncio.Task], None] | None = None,
):
    """The service's aiohttp app; `on_loop_end(task)` is called if the decoding loop ever ends
    while the app runs (the server then exits, not lingers unable to answer)."""
    web = require()
    app = web.Application(client_max_size=config.max_body)
    batcher_key = web.AppKey("batcher", Batcher)
    loop_key = web.AppKey("decoding_loop", asyncio.Task)

    translate = _translate_route(web, translator, config, batcher_key)

    graphs = translator.cuda_graphs  # nmt's engine on a GPU: whether its steps are graphs

    async def health(request):
        alive = not request.app[loop_key].done()
        shown = graphs()
        return web.json_response(
            {
                "status": "ok" if alive else "the decoding loop has stopped",
                "engine": translator.engine,
                "engine_why": translator.choice.why,
                "queued": request.app[batcher_key].pending,
                "decoding": len(request.app[batcher_key].decoding),  # batches
                "given_up": request.app[batcher_key].stopped,  # batches nobody waited for
                # how long the oldest request with no sentence decoding has been queued
                "oldest_wait_s": round(request.app[batcher_key].oldest_wait(), 3),
                "held_bytes": request.app[batcher_key].held,  # what the searches may hold (--max-memory)
                **({"cuda_graphs": shown} if shown is not None else {}),
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

    async def batching(app: Any) -> AsyncIterator[None]:
        batcher = app[batcher_key] = Batcher(translator, config)
        task = app[loop_key] = asyncio.get_running_loop().create_task(batcher.run())
        if on_loop_end is not None:
            task.add_done_callback(on_loop_end)
        yield
        if on_loop_end is not None:
            task.remove_done_callback(on_loop_end)
        task.cancel()
        # A batch in its thread may decode on (CTranslate2's cannot be stopped): wait for it
        # without holding the event loop, so that the drain's bound and a second signal act.
        await batcher.drained()
        batcher.decoder.shutdown(wait=False)

    @web.middleware
    async def in_progress(request, handler):  # a connection with a request running is not idle
        connections.started(request.transport)
        try:
            return await handler(request)
        finally:
            connections.finished(request.transport)

    app.middlewares.append(json_errors)
    app.middlewares.append(_guard(web, config))
    if connections is not None:
        app.middlewares.append(in_progress)
    app.cleanup_ctx.append(batching)
    app.router.add_post("/translate", translate)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/translate", not_allowed)
    return app


def run(
    model: Model, translate_config: TranslateConfig, config: ServeConfig, choice: Choice | None = None
) -> None:
    """Serve `model` until a signal; `choice`: its engine, where the caller chose it."""
    require()  # before the model loads: a missing or old aiohttp is one line
    translator = Served(model, translate_config, choice=choice, serving=True)
    connections = Connections(
        connection_limit(config.max_connections),
        config.header_timeout,
        config.write_timeout,
        config.max_connections_per_client,
    )
    ended: list[str] = []  # why the decoding loop ended, if it did

    async def main() -> None:
        stop = asyncio.Event()

        def loop_ended(task: asyncio.Task) -> None:
            failure = None if task.cancelled() else task.exception()
            ended.append(f"{type(failure).__name__}: {failure}" if failure else "it was cancelled")
            stop.set()

        app = make_app(translator, model, config, connections, on_loop_end=loop_ended)
        runner, server = await listen(app, connections, config)
        loop = asyncio.get_running_loop()
        watch = loop.create_task(connections.watch())
        host, port = server.sockets[0].getsockname()[:2]
        ui.say(f"serving {model.where} ({translator.engine}) on http://{host}:{port}")
        if not _loopback(config.host):
            ui.say(
                f"warning: --host {config.host} takes requests from other machines; nmt serve has no "
                "authentication or TLS: put it behind a proxy that has"
            )
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        ui.say("stopping: no new connections; answering the requests in flight (a second signal: at once)")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(
                sig, _exit_now, 128 + sig, "stopped at once: the requests in flight are lost"
            )
        server.close()
        try:  # answers the requests in flight, then closes their connections
            await asyncio.wait_for(runner.cleanup(), config.shutdown_timeout + 5)
        except asyncio.TimeoutError:  # a batch decodes on: its thread cannot be stopped
            _exit_now(1, f"the requests in flight were not answered within {config.shutdown_timeout:g} s")
        watch.cancel()
        ui.say("stopped")

    asyncio.run(main())
    if ended:
        raise NmtError(f"the decoding loop stopped ({ended[0]}): the server exited")


async def listen(app, connections: Connections, config: ServeConfig):
    """`app` served behind `connections` on config.host:config.port: (its runner, the server)."""
    web = require()
    # handler_cancellation: a request whose client disconnects is cancelled, so that it leaves
    # the decoding queue (aiohttp's default since 3.9 lets it run on). lingering_time: after
    # answering a request whose body was not read whole, aiohttp reads on for this long before
    # closing (10 s by default), so a client still sending sees the answer, not a reset; a
    # client that stalls would keep its connection that long.
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        shutdown_timeout=config.shutdown_timeout,
        handler_cancellation=True,
        lingering_time=1.0,
    )
    await runner.setup()
    connections.factory = with_json_errors(runner.server)
    loop = asyncio.get_running_loop()
    try:  # not web.TCPSite: it would hand connections to aiohttp's protocol unwatched
        server = await loop.create_server(connections, config.host, config.port, reuse_address=True)
    except OSError as e:
        await runner.cleanup()
        raise NmtError(f"cannot listen on {config.host}:{config.port}: {e.strerror}") from None
    return runner, server


def _exit_now(code: int, why: str) -> None:
    """Exit without waiting for the decoding thread (a process waits for its threads)."""
    ui.say(f"nmt serve: {why}")
    sys.stderr.flush()
    os._exit(code)


def _loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False
