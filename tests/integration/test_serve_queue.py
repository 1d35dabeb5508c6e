"""`nmt serve` in-process: its decoding queue and its connections, around a stand-in decoder
that fails, holds or gives up on demand."""

import json
import os
import signal
import threading
import time

import pytest
from conftest import DEADLINE

from nmt_cli.config import TranslateConfig
from nmt_cli.errors import NmtError, Stopped
from nmt_cli.inference.backend import Capacity, Choice
from nmt_cli.inference.models import from_dir


class StandIn:
    """Stands in for the translator in the server: fails on any batch holding "boom", waits for
    `release` on any holding "slow" (or gives up when nobody waits for it) or "stubborn", and
    upper-cases the rest; records each batch."""

    config, engine, tags, max_src, languages = TranslateConfig(), "stand-in", (), 1023, None
    choice = Choice("stand-in", "a test's")

    def __init__(self):
        self.batches: list = []
        self.options: list = []  # each batch's, a DecodeOptions per sentence
        self.stopped: list = []  # the batches given up midway
        self.finished: list = []  # the batches whose decoding ended, answered or not
        self.release = threading.Event()

    def many_targets(self):
        return ()

    def hypotheses(self, sentences, options, keys=None, prefixes=None, constraints=None, gone=None):
        self.batches.append(list(sentences))
        self.options.append(options)
        if "slow" in sentences:  # held, and given up as nmt's engine does between its steps
            deadline = time.monotonic() + DEADLINE
            while not self.release.wait(0.01) and time.monotonic() < deadline:
                if gone is not None and all(gone()):
                    self.stopped.append(list(sentences))
                    raise Stopped("nobody waits for this search any more")
        if "stubborn" in sentences:  # held whatever happens, as a CTranslate2 batch is
            self.release.wait(DEADLINE)
        self.finished.append(list(sentences))
        if "boom" in sentences:
            raise ValueError("the decoder failed")
        return [[s] for s in sentences]

    def texts(self, hyps):
        return [[h[0].upper()] for h in hyps]

    def work(self, sentences, options, prefixes=None, constraints=None):  # its hypotheses
        return self.work_of([1 if s else 0 for s in sentences], options)

    def work_of(self, lengths, options, forced=None, phrases=None):
        return [options.rows if n else 0 for n in lengths]

    def costs(self, sentences, options, prefixes=None, constraints=None):  # `size` bytes each
        return self.work(sentences, options), [self.size if s else 0 for s in sentences]

    size = 0

    def slots(self):
        return 1

    def cuda_graphs(self):
        return None

    def steps_in_turn(self):
        return self.engine == "nmt"

    def capacity(self):
        return Capacity()

    def search_in_callers(self, threads):
        pass

    def joins(self, options, prefixes=None, constraints=None):
        return False


class Costly(StandIn):
    """CTranslate2 with one worker (and `spare` spare ones), whose "stubborn" sentence is
    `stubborn` tokens of work at each hypothesis, the others a token a word."""

    engine = "ctranslate2"

    def __init__(self, spare: int, stubborn: int):
        super().__init__()
        self.spare, self.stubborn = spare, stubborn

    def capacity(self):
        return Capacity(workers=1, spare=self.spare)

    def work_of(self, lengths, options, forced=None, phrases=None):
        return [options.rows * n for n in lengths]

    def work(self, sentences, options, prefixes=None, constraints=None):
        return [options.rows * (self.stubborn if s == "stubborn" else len(s.split())) for s in sentences]


class Stepping(StandIn):
    """A stand-in that takes its steps as nmt's engine does: "slow" asks `gone` (where a step
    waits for its turn) every 10 ms while it is held."""

    engine = "nmt"


def _in_process(decoder: StandIn, scenario, on_loop_end=None, **config):
    """Run `scenario(post, get)` against the app over `decoder` on a local port; its result."""
    import asyncio
    from types import SimpleNamespace

    from aiohttp import ClientSession
    from aiohttp.test_utils import TestServer

    from nmt_cli.config import ServeConfig
    from nmt_cli.serve.app import make_app

    app = make_app(decoder, SimpleNamespace(where="stand-in"), ServeConfig(**config), on_loop_end=on_loop_end)

    async def run():
        async with TestServer(app) as server, ClientSession() as session:

            async def post(text):  # the sentences, or the whole request
                body = text if isinstance(text, dict) else {"text": text}
                async with session.post(server.make_url("/translate"), json=body) as r:
                    return r.status, await r.json()

            async def get(path):
                async with session.get(server.make_url(path)) as r:
                    return r.status, await r.json()

            return await scenario(post, get)

    # a scenario the server never answers fails the test rather than hanging the suite
    return asyncio.run(asyncio.wait_for(run(), 5 * DEADLINE))


def test_a_failing_request_fails_alone_and_health_sees_the_decoding_loop():
    """A batch the decoder fails on is decoded again request by request: only the request that
    fails gets the error, which names nothing of the server's. Once the decoding loop has
    stopped, /health answers 503, a request 503 at once, and the server is told (it exits)."""
    import asyncio

    async def scenario(post, get):
        good, bad = await asyncio.gather(post(["a", "b"]), post(["boom"]))
        alive = await get("/health")
        next(t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Batcher.run").cancel()
        await asyncio.sleep(0)
        return good, bad, alive, await get("/health"), await post(["late"])

    decoder, ended = StandIn(), []
    good, bad, alive, dead, late = _in_process(decoder, scenario, on_loop_end=ended.append, max_wait_ms=200)
    assert decoder.batches[0] == ["a", "b", "boom"]  # one batch, which failed
    assert good == (200, {"translations": ["A", "B"]})
    assert bad == (500, {"error": "decoding this request failed; the server's log says why"})
    assert (alive[0], alive[1]["status"]) == (200, "ok")
    assert (dead[0], dead[1]["status"]) == (503, "the decoding loop has stopped")
    assert late == (503, {"error": "the decoding loop has stopped"})
    assert len(ended) == 1 and ended[0].cancelled()


def test_a_batch_that_fails_after_its_client_left_does_not_stop_the_decoding_loop():
    """A one-request batch that fails after its request got its 504 (the answer's future is
    cancelled) is nobody's error: the loop goes on serving."""
    import asyncio

    decoder, ended = StandIn(), []

    async def scenario(post, get):
        gone = await post(["stubborn", "boom"])  # held past its deadline, then failing
        decoder.release.set()
        while (await get("/health"))[1]["queued"]:
            await asyncio.sleep(0.01)
        return gone, await get("/health"), await post(["after"])

    gone, health, after = _in_process(
        decoder, scenario, on_loop_end=ended.append, request_timeout=0.5, max_wait_ms=0
    )
    assert gone[0] == 504
    assert (health[0], health[1]["status"]) == (200, "ok")
    assert after == (200, {"translations": ["AFTER"]})
    assert not ended


def test_the_server_exits_when_its_decoding_loop_stops(package, monkeypatch):
    """No zombie: a server whose decoding loop has ended (here a fault planted in it) stops
    and says why, instead of answering every request 503 for ever."""
    from nmt_cli.config import ServeConfig
    from nmt_cli.serve import app as serve
    from nmt_cli.serve.batcher import Batcher

    async def broken(self):
        raise RuntimeError("a fault in the loop")

    monkeypatch.setattr(Batcher, "run", broken)
    lingering = threading.Timer(DEADLINE, os.kill, (os.getpid(), signal.SIGTERM))  # a zombie: stopped
    lingering.start()
    try:
        with pytest.raises(NmtError, match=r"loop stopped \(RuntimeError: a fault in the loop\)"):
            serve.run(from_dir(package), TranslateConfig(), ServeConfig(port=0))
    finally:
        lingering.cancel()


@pytest.mark.parametrize("timeouts", [{"write_timeout": 1.0}, {"header_timeout": 1.0}])
def test_a_client_that_never_reads_its_answers_loses_its_connection(timeouts):
    """A client that pipelines requests with large answers and reads none fills the socket's
    buffers: its connection is aborted after --write-timeout (writing paused that long) or, once
    no request is in progress, after --header-timeout (an answer still unread); closing it would
    wait for the answer to drain, for ever, holding its slot."""
    import asyncio
    import socket
    from types import SimpleNamespace

    from nmt_cli.config import ServeConfig
    from nmt_cli.serve.app import listen, make_app
    from nmt_cli.serve.connections import Connections

    config = ServeConfig(port=0, max_wait_ms=0, **{"write_timeout": 60.0, "header_timeout": 60.0, **timeouts})

    async def run():
        connections = Connections(10, config.header_timeout, config.write_timeout)
        app = make_app(StandIn(), SimpleNamespace(where="stand-in"), config, connections)
        runner, server = await listen(app, connections, config)
        watch = asyncio.ensure_future(connections.watch())
        loop = asyncio.get_running_loop()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        await loop.sock_connect(client, server.sockets[0].getsockname()[:2])
        body = json.dumps({"text": ["x" * 1999] * 256}).encode()  # 512 KB each way
        request = b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        request += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)

        async def send() -> None:
            try:
                for _ in range(8):
                    await loop.sock_sendall(client, request)
            except OSError:  # aborted
                pass

        sender = asyncio.ensure_future(send())
        while not connections.open:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        while connections.open and time.monotonic() - started < DEADLINE / 4:
            await asyncio.sleep(0.1)
        held = len(connections.open)
        sender.cancel()
        watch.cancel()
        client.close()
        server.close()
        await runner.cleanup()
        return held

    assert asyncio.run(run()) == 0


def test_a_request_past_its_deadline_gets_504_and_leaves_the_queue():
    """--request-timeout: a request not answered in time gets 504; one still queued then is
    never decoded, and the service goes on."""
    import asyncio

    decoder = StandIn()

    async def scenario(post, get):
        slow = asyncio.ensure_future(post(["stubborn"]))  # holds the decoder until released
        while not decoder.batches:
            await asyncio.sleep(0.01)
        queued = await post(["queued"])  # waits behind it, past its deadline
        waiting = await get("/health")
        decoder.release.set()
        return await slow, queued, waiting, await post(["after"])

    slow, queued, waiting, after = _in_process(decoder, scenario, request_timeout=0.5, max_wait_ms=0)
    assert slow[0] == queued[0] == 504 and "--request-timeout" in queued[1]["error"]
    assert waiting[1]["queued"] == 1  # the stubborn one, still being decoded; "queued" has left
    assert after == (200, {"translations": ["AFTER"]})
    assert ["queued"] not in decoder.batches


def test_a_batch_nobody_waits_for_is_given_up_between_steps():
    """A batch whose every request has left (504 here) stops decoding at its next step instead
    of running to its end for nobody; the decoder is free for the next request at once."""
    import asyncio

    decoder = StandIn()

    async def scenario(post, get):
        gone = await post(["slow", "held"])
        while (await get("/health"))[1]["given_up"] < 1:
            await asyncio.sleep(0.01)
        return gone, await post(["after"])

    gone, after = _in_process(decoder, scenario, request_timeout=0.5, max_wait_ms=0)
    assert gone[0] == 504 and after == (200, {"translations": ["AFTER"]})
    assert decoder.stopped == [["slow", "held"]] and not decoder.release.is_set()


def test_a_short_request_waits_for_one_batch_behind_a_large_one():
    """A large request is decoded in pieces, and the request served least goes first: short
    requests that arrive while a 12-sentence one is being decoded are in the very next batches
    (one at another beam, which cannot share a batch, in a batch of its own), and every request
    gets its answers whole and in order."""
    import asyncio

    decoder = StandIn()
    large = ["slow"] + [f"s{i}" for i in range(11)]

    async def scenario(post, get):
        first = asyncio.ensure_future(post(large))
        while not decoder.batches:  # its first piece holds the decoder
            await asyncio.sleep(0.01)
        short = asyncio.ensure_future(post(["short"]))
        while (await get("/health"))[1]["queued"] < 13:
            await asyncio.sleep(0.01)
        other = asyncio.ensure_future(post({"text": ["other"], "beam": 8}))
        while (await get("/health"))[1]["queued"] < 14:
            await asyncio.sleep(0.01)
        decoder.release.set()
        answered = await first, await short, await other
        return (*answered, await post({"text": ["w1", "w2", "w3"], "beam": 16}))

    first, short, other, wide = _in_process(decoder, scenario, max_batch=4, max_wait_ms=0)
    # 4 sentences at the default beam 4 per batch; at beam 16, one.
    assert decoder.batches[:5] == [large[:4], ["short", *large[4:7]], ["other"], large[7:11], large[11:]]
    assert decoder.batches[5:] == [["w1"], ["w2"], ["w3"]]
    assert first == (200, {"translations": [s.upper() for s in large]})
    assert short == (200, {"translations": ["SHORT"]}) and other == (200, {"translations": ["OTHER"]})
    assert wide == (200, {"translations": ["W1", "W2", "W3"]})


def test_requests_nobody_waits_for_are_not_decoded_again():
    """A batch that fails after its requests passed their deadline is not retried for them."""
    import asyncio

    decoder = StandIn()

    async def scenario(post, get):
        answers = asyncio.gather(post(["stubborn"]), post(["boom"]))  # one batch, held, then failing
        while not decoder.batches:
            await asyncio.sleep(0.01)
        done = await answers  # both past their deadline while the batch is held
        decoder.release.set()
        while (await get("/health"))[1]["queued"]:
            await asyncio.sleep(0.01)
        return done

    answers = _in_process(decoder, scenario, request_timeout=0.5, max_wait_ms=200)
    assert [status for status, _ in answers] == [504, 504]
    assert decoder.batches == [["stubborn", "boom"]]  # not decoded again one by one


def test_connections_per_client_address_are_capped():
    """--max-connections-per-client: past it, a client's new connection gets 503 and is closed;
    one of its connections closing makes room again."""
    import asyncio
    import socket
    from types import SimpleNamespace

    from nmt_cli.config import ServeConfig
    from nmt_cli.serve.app import listen, make_app
    from nmt_cli.serve.connections import Connections

    config = ServeConfig(port=0, max_connections_per_client=2)

    async def run():
        connections = Connections(10, 60.0, 30.0, config.max_connections_per_client)
        app = make_app(StandIn(), SimpleNamespace(where="stand-in"), config, connections)
        runner, server = await listen(app, connections, config)
        loop, where = asyncio.get_running_loop(), server.sockets[0].getsockname()[:2]

        async def connect() -> tuple[socket.socket, bytes]:
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, where)
            try:  # a refused connection is answered at once; an accepted one waits for a request
                return s, await asyncio.wait_for(loop.sock_recv(s, 4096), 0.5)
            except asyncio.TimeoutError:
                return s, b""

        first, second, third = [await connect() for _ in range(3)]
        first[0].close()
        while len(connections.open) > 1:
            await asyncio.sleep(0.01)
        fourth = await connect()
        for s, _ in (second, third, fourth):
            s.close()
        server.close()
        await runner.cleanup()
        return [answer for _, answer in (first, second, third, fourth)]

    first, second, third, fourth = asyncio.run(run())
    assert first == second == fourth == b""
    assert third.startswith(b"HTTP/1.1 503") and b"too many connections" in third


def test_the_queue_counts_work_not_sentences():
    """--max-queue 8: eight sentences' work at the default beam 4 (the stand-in's work: 4 for a
    sentence, nothing for a blank line). Behind one held sentence (4), two at beam 16 (32) wait
    for room (503), three (48) never fit (413); five at beam 4 (20) and a request of four blank
    lines and a sentence (4) are taken."""
    import asyncio

    decoder = StandIn()

    async def scenario(post, get):
        held = asyncio.ensure_future(post(["stubborn"]))
        while not decoder.batches:
            await asyncio.sleep(0.01)
        wide = await post({"text": ["a", "b"], "beam": 16})
        wider = await post({"text": ["a", "b", "c"], "beam": 16})
        queued = asyncio.ensure_future(post(["c", "d", "e", "f", "g"]))
        blank = asyncio.ensure_future(post(["", "", "", "", "h"]))
        while (await get("/health"))[1]["queued"] < 11:
            await asyncio.sleep(0.01)
        decoder.release.set()
        return wide, wider, await held, await queued, await blank

    wide, wider, held, queued, blank = _in_process(decoder, scenario, max_queue=8, max_wait_ms=0)
    assert wide[0] == 503 and "queue is full" in wide[1]["error"]
    assert wider[0] == 413 and "--max-queue" in wider[1]["error"]
    assert held == (200, {"translations": ["STUBBORN"]})
    assert queued == (200, {"translations": ["C", "D", "E", "F", "G"]})
    assert blank == (200, {"translations": ["", "", "", "", "H"]})


def test_requests_that_differ_only_in_seed_or_alpha_share_a_batch():
    """Queued behind a held batch: requests differing only in alpha, or only in seed, are each
    decoded in one batch, every sentence with its own request's options; another beam apart."""
    import asyncio

    decoder = StandIn()
    asked = [
        {"text": ["a"], "alpha": 0.0},
        {"text": ["b"], "alpha": 2.0},
        {"text": ["c"], "beam": 8},
        {"text": ["d"], "sample": True, "seed": 1},
        {"text": ["e"], "sample": True, "seed": 2},
    ]

    async def scenario(post, get):
        held = asyncio.ensure_future(post(["stubborn"]))
        while not decoder.batches:
            await asyncio.sleep(0.01)
        queued = []
        for request in asked:  # in this order: the queue serves the oldest first
            queued.append(asyncio.ensure_future(post(request)))
            while (await get("/health"))[1]["queued"] < 1 + len(queued):
                await asyncio.sleep(0.01)
        decoder.release.set()
        await held
        return [await q for q in queued]

    answers = _in_process(decoder, scenario, max_wait_ms=0)
    assert answers == [(200, {"translations": [x["text"][0].upper()]}) for x in asked]
    assert decoder.batches[1:] == [["a", "b"], ["c"], ["d", "e"]]
    assert [o.alpha for o in decoder.options[1]] == [0.0, 2.0]
    assert [o.seed for o in decoder.options[3]] == [1, 2]


@pytest.mark.parametrize("batching", [True, False])
def test_no_batching_decodes_each_request_alone(batching):
    """--no-batching: each request is a decoding batch of its own, however many wait together
    (with batching, requests that wait together share one)."""
    import asyncio

    decoder = StandIn()

    async def scenario(post, get):
        return await asyncio.gather(post(["a", "b"]), post(["c"]), post(["d", "e", "f"]))

    answers = _in_process(decoder, scenario, max_wait_ms=300, batching=batching)
    assert [a[1]["translations"] for a in answers] == [["A", "B"], ["C"], ["D", "E", "F"]]
    if batching:
        assert decoder.batches == [["a", "b", "c", "d", "e", "f"]]
    else:
        assert sorted(decoder.batches) == [["a", "b"], ["c"], ["d", "e", "f"]]


def test_an_answer_that_cannot_be_made_fails_its_request_alone(monkeypatch):
    """Two requests decoded in one batch: the one whose answer fails to be made gets a 500, the
    other its translations, and the decoding loop goes on."""
    import asyncio

    from nmt_cli.serve import batcher

    answer = batcher.answer_of

    def failing(texts, hyps, options):
        if any("BAD" in t for ts in texts for t in ts):
            raise ValueError("this answer cannot be made")
        return answer(texts, hyps, options)

    monkeypatch.setattr(batcher, "answer_of", failing)
    decoder = StandIn()

    async def scenario(post, get):
        both = await asyncio.gather(post(["bad"]), post(["good"]))
        return both, await post(["after"])

    (bad, good), after = _in_process(decoder, scenario, max_wait_ms=300)
    assert decoder.batches[0] == ["bad", "good"]  # one batch, the failing answer first
    assert good == (200, {"translations": ["GOOD"]})
    assert bad == (500, {"error": "decoding this request failed; the server's log says why"})
    assert after == (200, {"translations": ["AFTER"]})


def test_stopping_waits_for_a_batch_that_decodes_on_without_holding_the_event_loop():
    """A batch that cannot be stopped (a CTranslate2 batch; here a stand-in held for 30 s) is
    waited for when the server stops, but not on the event loop: the loop goes on running
    meanwhile, so the drain's bound and a second signal can still act."""
    import asyncio
    from types import SimpleNamespace

    from aiohttp import ClientSession, web

    from nmt_cli.config import ServeConfig
    from nmt_cli.serve.app import make_app

    decoder = StandIn()
    app = make_app(decoder, SimpleNamespace(where="stand-in"), ServeConfig(max_wait_ms=0))

    async def run():
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        async with ClientSession() as session:
            request = asyncio.ensure_future(
                session.post(f"http://127.0.0.1:{port}/translate", json={"text": ["stubborn"]})
            )
            while not decoder.batches:
                await asyncio.sleep(0.01)
            stopping = asyncio.ensure_future(runner.cleanup())
            await asyncio.sleep(0.5)  # the loop runs on while the batch is held
            seen = (stopping.done(), len(decoder.finished))
            decoder.release.set()
            await asyncio.wait_for(stopping, DEADLINE)
            request.cancel()
            return seen

    held = threading.Timer(30, decoder.release.set)  # the stand-in's own end, were the loop held
    held.start()
    try:
        seen = asyncio.run(run())
    finally:
        held.cancel()
    assert seen == (False, 0)  # the loop ran before the batch ended, and stopping waited for it
    assert decoder.finished == [["stubborn"]]  # and it was waited for


def test_a_request_that_arrives_while_a_long_one_decodes_starts_at_its_next_step():
    """With --concurrent-batches 4, nmt's engine decodes several batches at once, taking turns
    step by step, and CTranslate2 hands them to its workers side by side: a request that arrives
    while a long one is held is answered before the long one ends. A decoder that can do
    neither decodes one batch at a time: the request waits."""
    import asyncio

    def run(decoder):
        async def scenario(post, get):
            held = asyncio.ensure_future(post(["slow"]))
            while not decoder.batches:
                await asyncio.sleep(0.01)
            quick = asyncio.ensure_future(post(["quick"]))
            beside = decoder.engine in ("nmt", "ctranslate2")
            done, _ = await asyncio.wait([quick], timeout=DEADLINE / 4 if beside else 0.5)
            answered_first = bool(done)
            decoder.release.set()
            return answered_first, await held, await quick

        return _in_process(decoder, scenario, max_wait_ms=0, concurrent_batches=4)

    stepping = Stepping()
    assert run(stepping) == (True, (200, {"translations": ["SLOW"]}), (200, {"translations": ["QUICK"]}))
    assert stepping.finished == [["quick"], ["slow"]]
    workers = StandIn()
    workers.engine = "ctranslate2"
    assert run(workers)[0] is True and workers.finished == [["quick"], ["slow"]]
    apart = StandIn()
    assert run(apart)[0] is False and apart.finished == [["slow"], ["quick"]]
