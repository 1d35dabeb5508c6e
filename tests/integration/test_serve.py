"""`nmt serve`: a real server on the package, and the decoding queue with a stand-in decoder."""

import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import DEADLINE, Server, read_line, sources_of

from nmt_cli.config import DecodeOptions, ServeConfig, TranslateConfig
from nmt_cli.inference.models import from_dir
from nmt_cli.serve.contract import Served


def _until_closed(sock) -> bytes:
    """What a socket receives until the server closes the connection."""
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
    return answer


def test_the_service_answers_concurrent_requests_in_order(package, multi30k_bpe):
    sources = sources_of(multi30k_bpe)[:60]
    expected = Served(from_dir(package), TranslateConfig(engine="nmt")).translate(sources)
    server = Server(package, "--engine", "nmt", "--max-wait-ms", "20")  # constraints: nmt's engine's
    try:
        assert server.get("/health") == (
            200,
            {
                "status": "ok",
                "engine": "nmt",
                "engine_why": "--engine nmt",
                "queued": 0,
                "decoding": 0,
                "given_up": 0,
                "oldest_wait_s": 0.0,
                "held_bytes": 0,
            },  # no path
        )
        answers: dict[int, tuple] = {}

        def client(i: int) -> None:  # requests of 1 to 6 sentences, 12 at once
            part = list(range(i * 5, i * 5 + 1 + i % 6))
            status, body, _ = server.post({"text": [sources[j] for j in part]})
            answers[i] = (status, body, part)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE)
        assert len(answers) == 10
        for status, body, part in answers.values():
            assert status == 200 and body["translations"] == [expected[j] for j in part]
        status, body, _ = server.post({"text": [sources[0], ""], "beam": 4, "nbest": 2})
        assert status == 200 and len(body["translations"][0]) == 2
        assert body["translations"][0][0]["text"] == expected[0]
        assert body["translations"][1] == [{"text": "", "score": 0.0}] * 2
        capped = Served(from_dir(package), TranslateConfig(engine="nmt", decode=DecodeOptions(max_len=4)))
        assert server.post({"text": sources[:4], "max_len": 4})[:2] == (
            200,
            {"translations": capped.translate(sources[:4])},
        )
        for option, value in (("repetition_penalty", 2.0), ("coverage_penalty", 1.0)):
            penalty = TranslateConfig(engine="nmt", decode=DecodeOptions(**{option: value}))
            penalised = Served(from_dir(package), penalty)
            assert server.post({"text": sources[:6], option: value})[:2] == (
                200,
                {"translations": penalised.translate(sources[:6])},
            )
        status, body, _ = server.post({"text": sources[:2], "scores": True})
        assert status == 200 and [t["text"] for t in body["translations"]] == expected[:2]
        assert all(isinstance(t["score"], float) and t["score"] < 0 for t in body["translations"])
        status, body, _ = server.post({"text": sources[:2], "alignments": True})
        assert status == 200 and [t["text"] for t in body["translations"]] == expected[:2]
        assert all(re.fullmatch(r"\d+-\d+( \d+-\d+)*", t["alignment"]) for t in body["translations"])
        phrases = [["Hund"], [], ["roten Ball", "Wiese"]]
        status, body, _ = server.post({"text": sources[:3], "constraints": phrases})
        assert status == 200 and body["translations"][1] == expected[1]
        assert all(p in t for t, ps in zip(body["translations"], phrases) for p in ps), body
        # Draws depend on the request alone, not on the requests decoded in the same batch.
        sampled = TranslateConfig(engine="nmt", decode=DecodeOptions(sample=True, seed=4, nbest=2))
        drawn = Served(from_dir(package), sampled)
        request = {"text": sources[:4], "sample": True, "seed": 4, "nbest": 2}
        alone = drawn.texts(drawn.hypotheses(sources[:4], keys=[0, 1, 2, 3]))
        together: list = []
        clients = [threading.Thread(target=lambda: together.append(server.post(request))) for _ in range(3)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(DEADLINE)
        assert len(together) == 3
        for status, body, _ in together:
            assert status == 200 and [[h["text"] for h in t] for t in body["translations"]] == alone
    finally:
        assert server.stop() == 0


def test_the_service_refuses_bad_requests_and_keeps_serving(package):
    server = Server(package, "--max-queue", "4", "--max-output-len", "64")
    try:
        refused = [
            (b"{not json", 400),
            (b'{"text": "one string"}', 400),
            (b'{"text": [1, 2]}', 400),
            (b'{"text": []}', 400),
            (b"[]", 400),
            (b'{"text": ["a"], "beam": 0}', 400),
            (b'{"text": ["a"], "repetition_penalty": 0}', 400),
            (b'{"text": ["a"], "sample": true, "coverage_penalty": 1}', 400),
            (b'{"text": ["a"], "beam": 2, "nbest": 3}', 400),
            (b'{"txt": ["a"]}', 400),
            (b'{"text": ["\xff\xfe"]}', 400),
            (json.dumps({"text": [" ".join(["word"] * 10_000)]}).encode(), 400),
            (json.dumps({"text": ["x" * 100] * 300}).encode(), 413),
            (json.dumps({"text": ["y" * 1000] * 2000}).encode(), 413),  # 2 MB body
            (json.dumps({"text": ["a"] * 200, "beam": 16}).encode(), 413),  # 3200 hypotheses
            # past --max-queue 4: more work than four sentences of 32 pieces at beam 4
            (json.dumps({"text": ["a"] * 7}).encode(), 413),
            (json.dumps({"text": ["a"] * 6, "prefix": [" ".join(["Hund"] * 400)] * 6}).encode(), 413),
            # Numbers past every option's range, NaN and infinities (Python's json reads them all)
            (b'{"text": ["a"], "alpha": Infinity}', 400),
            (b'{"text": ["a"], "alpha": NaN}', 400),
            (b'{"text": ["a"], "alpha": 1e308}', 400),
            (b'{"text": ["a"], "max_len_a": 1e400}', 400),
            (b'{"text": ["a"], "max_len_b": 1' + b"0" * 399 + b"}", 400),
            (b'{"text": ["a"], "max_len_b": 1000000000}', 400),
            (b'{"text": ["a"], "max_len": 65}', 400),  # past --max-output-len 64
            (b'{"text": ["a"], "sample": true, "seed": -5}', 400),
            (b'{"text": ["a"], "sample": true, "topk": 1' + b"0" * 50 + b"}", 400),
            (b'{"text": ["a"], "sample": true, "temperature": 1e-300}', 400),
            (b'{"text": ["a"], "sample": true, "temperature": Infinity}', 400),
        ]
        for body, status in refused:
            got, answer, headers = server.post(body)
            assert (got, set(answer)) == (status, {"error"}), (body[:40], got, answer)
        # Thousands of nested brackets (the JSON parser recursed until RecursionError: 500 and
        # a traceback), and a compressed body, which is never decompressed.
        nested = b'{"text": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        assert server.post(nested)[:2] == (400, {"error": "the body is JSON nested too deeply"})
        import gzip

        bomb = gzip.compress(json.dumps({"text": ["a" * 1000] * 200}).encode())
        got, answer, _ = server.post(bomb, **{"Content-Encoding": "gzip"})
        assert got == 415 and "compressed" in answer["error"]
        assert server.get("/nowhere")[0] == 404 and server.get("/translate")[0] == 405
        # What a page in the operator's browser could send to 127.0.0.1: another Content-Type
        # (no CORS preflight), or our address under a name of its own (DNS rebinding).
        for headers, status in (
            ({"Content-Type": "text/plain"}, 415),
            ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
            ({"Host": "attacker.example:8080"}, 403),
        ):
            got, answer, _ = server.post({"text": ["a"]}, **headers)
            assert (got, set(answer)) == (status, {"error"}), headers
        # What aiohttp's HTTP parser refuses before any handler: JSON too, one line on stderr.
        import socket

        port = int(server.url.rsplit(":", 1)[1])
        for raw in (b"GARBAGE\r\n\r\n", b"POST /translate HTTP/1.1\r\nno colon\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:
                s.sendall(raw)
                answer = _until_closed(s)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 400") and b"application/json" in head, answer
            assert set(json.loads(body)) == {"error"}
        assert server.post({"text": ["A dog runs."]})[0] == 200  # still serving
        assert server.post({"text": [""] * 255 + ["A dog runs."]})[0] == 200  # blank lines weigh nothing
    finally:
        assert server.stop() == 0
    assert b"Traceback" not in server.proc.stderr.read()


def test_the_queue_weighs_a_sentence_by_its_hypotheses_and_output_limit(package):
    """Served.costs' work, which bounds `nmt serve`'s queue: hypotheses x output limit (a * |X| +
    b; raised by a prefix or constraints; capped by max_len and the model), a blank line nothing."""
    t = Served(from_dir(package), TranslateConfig())
    d = t.config.decode
    line = "A dog runs on the grass."
    n = len(t.encode([line])[0])
    assert t.costs([line, "", "  "], d)[0] == [d.rows * (n + d.max_len_b), 0, 0]
    assert t.costs([line], DecodeOptions(beam=8))[0] == [8 * (n + d.max_len_b)]
    assert t.costs([line], DecodeOptions(sample=True, nbest=3))[0] == [3 * (n + d.max_len_b)]
    assert t.costs([line], DecodeOptions(max_len=10))[0] == [d.rows * 10]
    long = " ".join(["Hund"] * 100)
    forced = len(t.encode_targets([long])[0])
    assert forced > n + d.max_len_b
    prefixed = t.costs([line, line], d, prefixes=[long, ""])[0]
    assert prefixed == [d.rows * (forced + 1), d.rows * (n + d.max_len_b)]
    assert t.costs([line], d, constraints=[[long, long]])[0] == [d.rows * min(2 * forced + 1, t.max_src)]


def test_the_server_listens_on_the_address_it_is_given(package):
    """--host: the server answers on that address and on no other (127.0.0.2 is this machine
    too, as the whole of 127.0.0.0/8 is)."""
    import socket

    server = Server(package, "--host", "127.0.0.2")
    try:
        assert server.host == "127.0.0.2"
        assert server.get("/health")[0] == 200
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE).close()
    finally:
        assert server.stop() == 0


def test_a_body_over_the_limit_is_refused_by_its_head_before_it_is_read(package):
    """--max-body: a request whose Content-Length is over it gets its 413 at once, its body
    never read (it was read, or waited for, first); --max-chars is an option too."""
    import socket

    server = Server(package, "--max-body", "1000", "--max-chars", "20")
    try:
        with socket.create_connection((server.host, server.port), timeout=DEADLINE) as s:
            s.sendall(
                b"POST /translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b'Content-Length: 5000000\r\n\r\n{"text": ["'
            )
            start = time.monotonic()
            head = s.recv(4096)
            assert time.monotonic() - start < 5, head
        assert head.startswith(b"HTTP/1.1 413") and b"--max-body" in head, head
        assert server.post({"text": ["x" * 21]})[0] == 400
        assert server.get("/health")[0] == 200
    finally:
        assert server.stop() == 0


def test_an_api_key_guards_translate_but_not_health(package):
    server = Server(package, env={"NMT_API_KEY": "s3cret"})
    try:
        assert server.post({"text": ["A dog runs."]})[:2] == (401, {"error": "a valid API key is required"})
        assert server.post({"text": ["A dog runs."]}, Authorization="Bearer wrong")[0] == 401
        assert server.post({"text": ["A dog runs."]}, Authorization="Bearer s3cret")[0] == 200
        assert server.post({"text": ["A dog runs."]}, Authorization="bearer s3cret")[0] == 200  # any case
        assert server.post({"text": ["A dog runs."]}, Authorization="Basic s3cret")[0] == 401
        assert server.post({"text": ["A dog runs."]}, Authorization="Bearer s3cre")[0] == 401
        assert server.get("/health")[0] == 200
        # any other route too: a decoding route added later is guarded without a word
        assert server.post({"text": ["A dog runs."]}, path="/score")[0] == 401
        assert server.post({"text": ["A dog runs."]}, path="/score", Authorization="Bearer s3cret")[0] == 404
    finally:
        assert server.stop() == 0
    assert b"s3cret" not in server.proc.stderr.read()


@pytest.mark.parametrize("engine", ["nmt", "ctranslate2"])
def test_a_request_whose_client_leaves_is_dropped_from_the_queue(package, multi30k_bpe, engine):
    """A client that disconnects while its request waits behind another (or decodes beside it)
    frees its place: its queued sentences leave the queue at once instead of being decoded for
    nobody; a piece of it decoding beside leaves at its next step (nmt's engine) or when its
    batch ends (CTranslate2 decodes a batch whole)."""

    sources = sources_of(multi30k_bpe)[:500]
    server = Server(package, "--engine", engine, "--max-queue", "1000", "--max-sentences", "500")
    answer: list = []
    try:
        first = threading.Thread(target=lambda: answer.append(server.post({"text": sources})))
        first.start()
        deadline = time.monotonic() + DEADLINE
        while server.get("/health")[1]["queued"] < 500:  # the first request is being decoded
            assert time.monotonic() < deadline and not answer
            time.sleep(0.005)
        leaving = server.sent({"text": sources[:300]})
        seen = []
        while not seen or seen[-1] != 800:  # queued behind the first
            assert time.monotonic() < deadline and not answer, seen
            seen.append(server.get("/health")[1]["queued"])
        leaving.close()
        # at most one batch of it decoding on (CTranslate2), none past its next step (nmt's)
        beside = ServeConfig().max_batch if engine == "ctranslate2" else 0
        while seen[-1] > 500 + beside:
            assert time.monotonic() < deadline, seen
            seen.append(server.get("/health")[1]["queued"])
        # Its queued sentences left together (not piece by piece as their turns came), while the
        # first request was still being decoded.
        drops = [a - b for a, b in zip(seen, seen[1:])]
        assert max(drops) >= 300 - ServeConfig().max_batch and not answer, seen
        first.join(DEADLINE)
        assert answer[0][0] == 200 and len(answer[0][1]["translations"]) == 500
        assert server.get("/health")[1]["queued"] == 0
    finally:
        assert server.stop() == 0


def test_the_batch_of_a_client_that_leaves_stops_decoding(package, multi30k_bpe):
    """The most expensive request allowed (2,048 hypotheses at beam 8), its client gone while
    its first pieces decode: they are given up between two steps, its other pieces never
    start, and the next client is served."""

    sources = sources_of(multi30k_bpe)[:256]
    server = Server(package, "--engine", "nmt", "--threads", "2")  # two lanes: at most 4 running batches
    try:
        leaving = server.sent({"text": sources, "beam": 8, "max_len_a": 3.0})
        deadline = time.monotonic() + DEADLINE
        while server.get("/health")[1]["queued"] < 256:  # its first pieces are being decoded
            assert time.monotonic() < deadline
            time.sleep(0.005)
        leaving.close()
        # each lane gives its piece up at its next step (a lane waits for its turn to step)
        while (health := server.get("/health")[1])["given_up"] < 1 or health["queued"]:
            assert time.monotonic() < deadline, health
            time.sleep(0.005)
        # one give-up per running batch that held a piece, not one for each of its 16 pieces
        assert health["given_up"] <= 4, health
        assert server.post({"text": sources[:2]})[0] == 200
    finally:
        assert server.stop() == 0


def test_the_costliest_request_allowed_holds_no_other_up(package, multi30k_bpe):
    """8 sentences at the widest beam, kept decoding to the model's limit by min_len (what the
    caps allow at most): a one-sentence request sent while it decodes is answered, exactly as
    `nmt translate` answers it, before the costly one ends (at the defaults, nmt's engine
    decodes them in running batches of their own options that take their steps in turn);
    past the caps, 400."""
    sources = sources_of(multi30k_bpe)[:8]
    expected = Served(from_dir(package), TranslateConfig(engine="nmt")).translate(sources[:2])
    server = Server(package, "--engine", "nmt")
    try:
        costly = {"text": sources, "beam": 16, "min_len": 1023, "max_len_b": 1023}
        for past in ({"min_len": 100_000}, {"max_len_b": 100_000}, {"max_len": 1024}, {"beam": 17}):
            status, body, _ = server.post({**costly, **past})
            assert status == 400 and "on this server" in body["error"], body
        leaving = server.sent(costly)
        deadline = time.monotonic() + DEADLINE
        while (health := server.get("/health")[1])["decoding"] < 1 or health["queued"] < 8:
            assert time.monotonic() < deadline, health
            time.sleep(0.005)
        assert server.post({"text": sources[:2]})[:2] == (200, {"translations": expected})
        assert server.get("/health")[1]["queued"] >= 8, "the costly request ended first"
        leaving.close()
        while (health := server.get("/health")[1])["given_up"] < 1 or health["queued"]:
            assert time.monotonic() < deadline, health
            time.sleep(0.005)
    finally:
        assert server.stop() == 0


def test_a_body_that_does_not_arrive_gets_408_and_its_connection_closed(package):
    """--read-timeout: a client whose Content-Length promises more than it sends does not hold
    its connection for ever."""
    import socket

    server = Server(package, "--read-timeout", "1")
    try:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as stalling:
            stalling.sendall(
                b"POST /translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"text": ["'
            )
            answer = _until_closed(stalling)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert "did not arrive within 1 s" in json.loads(body)["error"]
        assert server.post({"text": ["A dog runs."]})[0] == 200  # still serving
    finally:
        assert server.stop() == 0


def test_connections_without_a_whole_request_are_closed_and_their_number_capped(package):
    """--header-timeout and --max-connections (slowloris): connections that send half a request
    head, and go on sending bits of it, get a 408 and are closed once the timeout passes; past the cap a new
    connection gets a JSON 503 and is closed; then the service answers as before."""
    import socket

    server = Server(package, "--header-timeout", "1", "--max-connections", "6")
    port = int(server.url.rsplit(":", 1)[1])
    stalled = []
    try:
        for _ in range(6):
            stalled.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            stalled[-1].sendall(b"POST /translate HTTP/1.1\r\nHost: localhost\r\n")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            answer = _until_closed(extra)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        assert json.loads(body) == {"error": "too many connections: retry shortly"}
        start = time.monotonic()
        time.sleep(0.5)
        for s in stalled:  # data arriving does not count as a request
            s.sendall(b"X-Slow: 1\r\n")
        for s in stalled:  # a 408, then closed by the server
            answer = _until_closed(s)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), answer
            assert json.loads(body) == {"error": "the request's head did not arrive within 1 s"}
        assert time.monotonic() - start < 4
        assert server.get("/health")[0] == 200
        assert server.post({"text": ["A dog runs."]})[0] == 200
    finally:
        for s in stalled:
            s.close()
        assert server.stop() == 0


def test_sigterm_finishes_the_requests_in_flight(package, multi30k_bpe):
    sources = sources_of(multi30k_bpe)[:500]
    server = Server(package, "--max-queue", "1000", "--max-sentences", "500")
    answer: list = []
    request = threading.Thread(target=lambda: answer.append(server.post({"text": sources})))
    request.start()
    time.sleep(0.05)
    deadline = time.monotonic() + DEADLINE
    while server.get("/health")[1]["queued"] == 0 and not answer:  # in, not yet answered
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert not answer  # SIGTERM comes while the request is in flight
    assert server.stop() == 0
    request.join(DEADLINE)
    status, body, _ = answer[0]
    assert status == 200 and len(body["translations"]) == 500
    with pytest.raises(urllib.error.URLError):  # and it listens no more
        server.get("/health")


def test_a_second_signal_stops_the_drain_at_once(package, multi30k_bpe):
    """SIGTERM drains; a second SIGTERM while it drains exits at once (143), the request in
    flight lost and said so, instead of being ignored."""
    sources = sources_of(multi30k_bpe)[:500]
    server = Server(
        package, "--max-queue", "1000", "--max-sentences", "500", "--beam", "8", "--max-hypotheses", "4000"
    )
    answer: list = []

    def ask() -> None:
        try:
            answer.append(server.post({"text": sources}))
        except (urllib.error.URLError, ConnectionError) as e:  # the connection dropped, unanswered
            answer.append((None, str(e), {}))

    request = threading.Thread(target=ask, daemon=True)
    request.start()
    deadline = time.monotonic() + DEADLINE
    while server.get("/health")[1]["queued"] == 0 and not answer:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert not answer  # both signals come while the request is in flight, not after it was refused
    server.proc.send_signal(signal.SIGTERM)
    read_line(server.proc.stderr, DEADLINE)  # "stopping: ..."
    server.proc.send_signal(signal.SIGTERM)
    try:
        assert server.proc.wait(DEADLINE) == 128 + signal.SIGTERM
    finally:
        server.proc.kill()
    assert b"stopped at once: the requests in flight are lost" in server.proc.stderr.read()
    request.join(DEADLINE)
    assert answer and answer[0][0] is None, answer  # lost: the connection closed unanswered


def test_searches_that_take_turns_run_in_their_callers_thread(trained, monkeypatch):
    """With --concurrent-batches above 1 each batch's searches run one after another in its
    own decoding thread: a worker thread done with its share of a call would hold a turn it no
    longer uses, and with two such the server's batches waited on each other for ever."""
    import asyncio

    from nmt_cli.config import ServeConfig
    from nmt_cli.engine import decoding
    from nmt_cli.serve.batcher import Batcher

    seen: list = []
    translate = decoding.translate
    monkeypatch.setattr(
        decoding, "translate", lambda *a, **k: seen.append(threading.get_ident()) or translate(*a, **k)
    )
    lines = [f"a dog runs {'on the grass ' * i}." for i in range(8)]
    for at_once, apart in ((1, True), (4, False)):
        translator = Served.load(trained, engine="nmt", threads=2, batch_size=2, max_len_b=6)

        async def serve(translator=translator, at_once=at_once) -> list:
            config = ServeConfig(concurrent_batches=at_once, max_wait_ms=0, running_batch=False)
            batcher = Batcher(translator, config)
            loop = asyncio.create_task(batcher.run())
            await asyncio.sleep(0)
            try:
                return await asyncio.wait_for(batcher.submit(lines, translator.config.decode), DEADLINE)
            finally:
                loop.cancel()
                batcher.decoder.shutdown(wait=True)

        seen.clear()
        assert len(asyncio.run(serve())) == 8
        assert len(seen) == 4 and (len(set(seen)) > 1) == apart, seen
