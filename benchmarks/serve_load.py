"""`nmt serve` under honest, greedy, stalling and hostile clients, and a SIGTERM under load
(localhost only; every loop is bounded). Prints JSON lines and markdown rows.

    python benchmarks/serve_load.py RUN [--clients 16] [--requests 1500] [--ct2 int8] [--stalled 500]

RUN's model is exported (--ct2: then as a CTranslate2 export of that quantization) and served
with the default settings, a fresh server for each part:

- honest: `--clients` threads, each one request at a time of 1-8 validation sentences, with
  dynamic batching and without: requests/s, sentences/s, p50/p99 latency; every answer is
  checked against `nmt translate`'s.
- greedy: the same honest load beside one client that sends the largest request allowed (256
  of the longest sentences at beam 8: --max-hypotheses) again and again: the honest p99
  against the honest part's (target: within 2x), none lost, none wrong.
- costly: the same beside one client looping the costliest request the caps allow: 8 of the
  longest sentences at the widest beam (--max-beam 16), kept decoding to the model's limit by
  min_len; the server's peak memory (VmHWM) and, alone, that request's seconds.
- stalled: `--stalled` connections that send half a request head and wait; /health and one
  honest request must answer within 1 s, and the server closes the stalled ones within
  --header-timeout.
- hostile: a list of bad requests (malformed HTTP, nested JSON, wrong types, huge and
  compressed bodies, invalid UTF-8, control characters, options out of range), each with the
  status it must get; then /health and an honest request.
- unread: `--unread` clients that each ask for the largest answer that costs no decoding (256
  empty lines, n-best 8, scores) and never read it: /health and an honest request meanwhile,
  and how many of them the server let go within 15 s (--write-timeout 10).
- sigterm: SIGTERM while the honest clients send: every request sent is answered (200) or
  refused (503), and the process is gone within the drain deadline.
- lockout: the honest load (`--attacked-requests` of it, `--attacked-clients` clients) beside
  four attacking keys, two clients each half a request apart, looping one-word requests at beam
  1 with min_len 1000-k and max_len_b 1000 (four option keys whose running batches would never
  empty); every server with --request-timeout 10, so that a request locked out costs 10 s, and
  its latency (a 504's too) counts.
- long: the same beside four clients looping 8 sentences of about 1,900 characters each
  (validation sentences joined, near --max-chars: the searches that hold the most memory), with
  the default --max-memory and with 256 MiB.
- refused: the same beside two clients looping a 0.9 MB body of 300 sentences (413: past
  --max-sentences, known only once the body is parsed).
  With any of these three, that honest load alone first, on a server with the same settings.

--before REV: instead, the honest load with dynamic batching (or, if --parts names them, the
lockout and long parts), `--rounds` rounds alternated with the server of git revision REV (a
worktree of it exporting its own package of RUN, or of --before-run: a copy of RUN whose records
REV can read; its own CTranslate2 export with --ct2).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import checkout, cpu_name  # noqa: E402
from benchmarks.deploy import NMT, exports, nmt, split_files  # noqa: E402

GREEDY_BEAM = 8
SERVER_OPTIONS: list[str] = []  # --server-option: given to every server started (e.g. --concurrent-batches 4)
COSTLY_BEAM = 16  # --max-beam's default


class Server:
    """`nmt serve` on `model` in a process of its own."""

    def __init__(self, model: Path, *options: str, root: Path = ROOT):
        # its log goes to a file: a pipe nobody reads would block the server once full
        self.log = tempfile.NamedTemporaryFile(prefix="nmt-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [*NMT, "serve", "--model", str(model), "--port", "0", *SERVER_OPTIONS, *options],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            cwd=root,
        )
        self.log.close()  # the server writes it through its own descriptor
        while not (found := re.search(rb":(\d+)", Path(self.log.name).read_bytes())):
            if self.proc.poll() is not None:
                raise RuntimeError(Path(self.log.name).read_text())
            time.sleep(0.05)
        self.port = int(found.group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def logged(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> float:
        """SIGTERM; the seconds until the process is gone."""
        start = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        finally:
            self.proc.kill()
        took = time.perf_counter() - start
        failed = [line for line in self.logged().splitlines() if " failed" in line]
        if failed:  # shown, not hidden: a figure measured beside failures says so
            print(f"server log: {len(failed)} failures, the first: {failed[0]}", file=sys.stderr, flush=True)
        os.unlink(self.log.name)
        return took


def post(url: str, body: bytes, timeout: float = 300, **headers: str) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **headers}
    request = urllib.request.Request(url + "/translate", data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def load(
    url: str, requests: list[list[str]], expected: dict[str, str], clients: int, stop=None, every=False
) -> dict:
    """`clients` threads send `requests`, each one at a time. Returns the seconds it took, each
    answered request's latency (`every`: each request's, answered or not), the statuses of those
    not answered, and the wrong answers."""
    todo, lock = list(enumerate(requests)), threading.Lock()
    out: dict = {"latencies": [], "refused": [], "lost": [], "wrong": 0}

    def client() -> None:
        while not (stop and stop.is_set()):
            with lock:
                if not todo:
                    return
                i, sentences = todo.pop()
            start = time.perf_counter()
            try:
                status, answer = post(url, json.dumps({"text": sentences}).encode())
            except urllib.error.URLError as e:
                # Refused at connect: the server no longer listens; the request was never in flight.
                key = "refused" if isinstance(e.reason, ConnectionRefusedError) else "lost"
                out[key].append(str(e.reason))
                continue
            except Exception as e:  # noqa: BLE001 - a request sent and never answered
                out["lost"].append(repr(e))
                continue
            if every:
                out["latencies"].append(time.perf_counter() - start)
            if status != 200:
                out["refused" if status == 503 else "lost"].append(status)
                continue
            if not every:
                out["latencies"].append(time.perf_counter() - start)
            if answer["translations"] != [expected[s] for s in sentences]:
                out["wrong"] += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["seconds"] = time.perf_counter() - start
    return out


def summary(part: str, result: dict, sentences: int) -> dict:
    q = statistics.quantiles(result["latencies"], n=100)
    return {
        "part": part,
        "answered": len(result["latencies"]),
        "refused_503": len(result["refused"]),
        "lost": len(result["lost"]),
        "unlike_nmt_translate": result["wrong"],
        "requests_per_s": round(len(result["latencies"]) / result["seconds"], 1),
        "sentences_per_s": round(sentences / result["seconds"], 1),
        "p50_ms": round(q[49] * 1000),
        "p99_ms": round(q[98] * 1000),
    }


def honest(served: Path, requests, expected, clients: int) -> dict:
    rows = {}
    for name, options in (("honest", ["--max-wait-ms", "5"]), ("honest, --no-batching", ["--no-batching"])):
        server = Server(served, *options)
        try:
            rows[name] = summary(name, load(server.url, requests, expected, clients), sum(map(len, requests)))
        finally:
            server.stop()
        print(json.dumps(rows[name]), flush=True)
    return rows["honest"]


def before(served: Path, requests, expected, args, pool) -> None:
    """The honest load (or the attacks) on this tree's server and on revision `args.before`'s,
    alternated."""
    work = served.parent
    with checkout(args.before, work / "before") as old:
        theirs = work / "before-package"
        fmt = ["--format", "ctranslate2", "--quantization", args.ct2] if args.ct2 else []
        run = str((args.before_run or args.run).resolve())
        nmt("export", str(theirs), "--run-dir", run, *fmt, cwd=old)
        servers = {"this tree": (served, ROOT), args.before: (theirs, old)}
        for round_ in range(1, args.rounds + 1):
            for name, (model, root) in servers.items():
                if {"lockout", "long", "refused"} & set(args.parts):
                    attacks(model, root, f"{name}, round {round_}", args, pool, expected)
                    continue
                server = Server(model, "--max-wait-ms", "5", root=root)
                try:
                    result = load(server.url, requests, expected, args.clients)
                finally:
                    server.stop()
                row = summary(f"honest, {name}, round {round_}", result, sum(map(len, requests)))
                print(json.dumps(row), flush=True)


def greedy(served: Path, requests, expected, clients: int, pool: list[str], baseline: dict) -> None:
    largest = sorted(pool, key=len, reverse=True)[:256]
    body = json.dumps({"text": largest, "beam": GREEDY_BEAM}).encode()
    server = Server(served)
    stop, greedy_answers = threading.Event(), []

    def hog() -> None:
        while not stop.is_set():
            status, _ = post(server.url, body)
            greedy_answers.append(status)

    try:
        hogging = threading.Thread(target=hog)
        hogging.start()
        time.sleep(1.0)  # its first request is queued before the honest ones
        result = load(server.url, requests, expected, clients)
        stop.set()
        hogging.join()
    finally:
        server.stop()
    row = summary("honest beside one greedy client", result, sum(map(len, requests)))
    row["greedy_requests_answered"] = greedy_answers.count(200)
    row["p99_vs_honest_alone"] = round(row["p99_ms"] / baseline["p99_ms"], 2)
    print(json.dumps(row), flush=True)


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory so far (Linux's VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def costly(served: Path, requests, expected, clients: int, pool: list[str], baseline: dict) -> None:
    limit = 1023  # the model's output limit (max_positions - 1), what min_len may reach
    largest = sorted(pool, key=len, reverse=True)[:8]
    body = json.dumps({"text": largest, "beam": COSTLY_BEAM, "min_len": limit, "max_len_b": limit}).encode()
    server = Server(served)
    stop, answers = threading.Event(), []
    try:
        start = time.perf_counter()
        status, _ = post(server.url, body, timeout=600)
        alone_s, rss_alone = time.perf_counter() - start, peak_rss_mb(server.proc.pid)

        def hog() -> None:
            while not stop.is_set():
                answers.append(post(server.url, body, timeout=600)[0])

        hogging = threading.Thread(target=hog)
        hogging.start()
        time.sleep(1.0)
        result = load(server.url, requests, expected, clients)
        stop.set()
        hogging.join()
        rss = peak_rss_mb(server.proc.pid)
    finally:
        server.stop()
    part = "honest beside one client looping the costliest request allowed"
    row = summary(part, result, sum(map(len, requests)))
    row["costly_alone_s"] = round(alone_s, 1)
    row["costly_alone_status"] = status
    row["costly_requests_answered"] = answers.count(200)
    row["costly_statuses"] = sorted(set(answers))
    row["server_peak_rss_mb_costly_alone"] = rss_alone
    row["server_peak_rss_mb"] = rss
    row["p99_vs_honest_alone"] = round(row["p99_ms"] / baseline["p99_ms"], 2)
    print(json.dumps(row), flush=True)


LOCKED_OUT_AFTER = 10  # --request-timeout of the attacked servers: a locked-out request's cost


def attack_bodies(kind: str, pool: list[str]) -> list[tuple[bytes, float]]:
    """Each attacking client's request and the seconds it waits before its first."""
    if kind == "lockout":
        bodies = [
            json.dumps({"text": ["a"], "beam": 1, "min_len": 1000 - k, "max_len_b": 1000}).encode()
            for k in range(4)
        ]
        return [(body, delay) for body in bodies for delay in (0.0, 0.5)]
    if kind == "alone":
        return []
    if kind == "refused":
        return [(json.dumps({"text": ["x" * 3000] * 300}).encode(), 0.0)] * 2
    # 8 sentences of validation text near --max-chars (2,000) each: the searches holding most
    joined, long = "", []
    for line in sorted(pool, key=len, reverse=True):
        joined = f"{joined} {line}".strip()
        if len(joined) > 1800:
            long.append(joined[:1990])
            joined = ""
        if len(long) == 8:
            break
    return [(json.dumps({"text": long}).encode(), 0.0)] * 4


def attacked(
    model: Path, root: Path, kind: str, options: list[str], pool, requests, expected, clients
) -> dict:
    """The honest load on `root`'s server of `model` beside the `kind` attack: its latencies
    (504s included) and the attackers' answers."""
    server = Server(model, "--request-timeout", str(LOCKED_OUT_AFTER), *options, root=root)
    stop, statuses = threading.Event(), []

    def attacker(body: bytes, delay: float) -> None:
        time.sleep(delay)
        while not stop.is_set():
            try:
                statuses.append(post(server.url, body, timeout=120)[0])
            except Exception as e:  # noqa: BLE001 - counted, the attack goes on
                statuses.append(type(e).__name__)

    try:
        threads = [threading.Thread(target=attacker, args=a) for a in attack_bodies(kind, pool)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # the attack holds the server before the honest clients come
        result = load(server.url, requests, expected, clients, every=True)
        stop.set()
        for t in threads:
            t.join()
        rss = peak_rss_mb(server.proc.pid)
    finally:
        server.stop()
    row = summary(f"honest beside {kind}", result, sum(map(len, requests)))
    row["timed_out_504"] = result["lost"].count(504)
    row["attacking_answered"] = statuses.count(200)
    row["server_peak_rss_mb"] = rss
    return row


def attacks(served: Path, root: Path, name: str, args, pool, expected) -> None:
    rng = random.Random(1)
    requests = [rng.sample(pool, rng.randint(1, 8)) for _ in range(args.attacked_requests)]
    for part, options in (
        ("alone", []),
        ("lockout", []),
        ("long", []),
        ("long", ["--max-memory", "256"]),
        ("refused", []),
    ):
        if part not in args.parts and not (
            part == "alone" and {"lockout", "long", "refused"} & set(args.parts)
        ):
            continue
        row = attacked(served, root, part, options, pool, requests, expected, args.attacked_clients)
        row["server"] = " ".join([name, *options])
        print(json.dumps(row), flush=True)


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed `s`, at once or after its 408 (a half-sent head gets one)."""
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        return False
    return got == b"" or got.startswith(b"HTTP/1.1 408")


def _probe(server: Server, probe: list[str], expected: dict[str, str]) -> dict:
    """/health and one honest request while the server holds other clients: their status and
    time, and whether the translations are `nmt translate`'s."""
    start = time.perf_counter()
    with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
        health = (r.status, time.perf_counter() - start)
    start = time.perf_counter()
    status, answer = post(server.url, json.dumps({"text": probe}).encode(), timeout=30)
    return {
        "health_status": health[0],
        "health_ms": round(health[1] * 1000),
        "translate_status": status,
        "translate_ms": round((time.perf_counter() - start) * 1000),
        "translate_right": answer.get("translations") == [expected[s] for s in probe],
    }


def stalled(served: Path, count: int, probe: list[str], expected: dict[str, str]) -> None:
    server = Server(served)
    sockets = []
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            s.sendall(b"POST /translate HTTP/1.1\r\nHost: localhost\r\n")
            sockets.append(s)
        opened = time.perf_counter()
        probed = _probe(server, probe, expected)
        closed = sum(_closed_by_server(s) for s in sockets)
        all_closed_s = time.perf_counter() - opened
    finally:
        for s in sockets:
            s.close()
        server.stop()
    row = {
        "part": f"{count} stalled connections",
        **probed,
        "stalled_closed_by_server": closed,
        "all_closed_after_s": round(all_closed_s, 1),
    }
    print(json.dumps(row), flush=True)


def unread(served: Path, count: int, probe: list[str], expected: dict[str, str]) -> None:
    """`count` clients that each send the largest answer allowed that costs no decoding (256
    empty lines x n-best 8 with scores) and never read it: whether the server stays healthy, and
    how many of them it lets go within 15 s (--write-timeout, or --header-timeout once idle with
    the answer unread)."""
    server = Server(served, "--max-connections", str(count + 64), "--write-timeout", "10")
    body = json.dumps({"text": [""] * 256, "beam": 8, "nbest": 8, "scores": True}).encode()
    request = (
        b"POST /translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(30)
            s.connect(("127.0.0.1", server.port))
            s.sendall(request)
            sockets.append(s)
        sent = time.perf_counter()
        probed = _probe(server, probe, expected)
        time.sleep(max(0.0, 15 - (time.perf_counter() - sent)))  # the timeouts (10 s) and a margin
        released = 0
        for s in sockets:
            s.settimeout(2)
            try:
                while s.recv(1 << 16):
                    pass
                released += 1  # closed after what fitted the buffers
            except ConnectionResetError:
                released += 1  # aborted
            except TimeoutError:
                pass  # still held open by the server
    finally:
        for s in sockets:
            s.close()
        server.stop()
    row = {
        "part": f"{count} clients that never read their answers",
        "answer_bytes": len(json.dumps({"translations": [[{"text": "", "score": 0.0}] * 8] * 256})),
        **probed,
        "released_by_server_within_15_s": released,
    }
    print(json.dumps(row), flush=True)


def raw(port: int, data: bytes) -> int:
    """The status of the answer to `data` sent as is."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer:
                break
    return int(answer.split(b" ", 2)[1])


def hostile(served: Path, probe: list[str], expected: dict[str, str]) -> None:
    ok = json.dumps({"text": probe}).encode()
    many = json.dumps({"text": ["a"] * 300}).encode()
    wide = json.dumps({"text": ["a"] * 256, "beam": 16}).encode()
    stall = {"text": ["a dog"] * 8, "beam": 16, "max_len_b": 100_000}
    cases = [  # (what, the status it must get, how it is sent, what is sent)
        ("malformed request line", 400, "raw", b"GARBAGE\r\n\r\n"),
        ("header line without a colon", 400, "raw", b"POST /translate HTTP/1.1\r\nnocolon\r\n\r\n"),
        ("nested JSON, 5,000 deep", 400, "post", b'{"text": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("not JSON", 400, "post", b"{text"),
        ("text not a list", 400, "post", b'{"text": "a"}'),
        ("text of numbers", 400, "post", b'{"text": [1, 2]}'),
        ("empty text", 400, "post", b'{"text": []}'),
        ("unknown field", 400, "post", b'{"text": ["a"], "beem": 4}'),
        ("invalid UTF-8", 400, "post", b'{"text": ["\xff\xfe"]}'),
        ("raw control character in a string", 400, "post", b'{"text": ["a\x01b"]}'),
        ("beam 0", 400, "post", b'{"text": ["a"], "beam": 0}'),
        ("beam 1000", 400, "post", b'{"text": ["a"], "beam": 1000}'),
        ("bearer in lower case, no --api-key", 200, "post-bearer", ok),
        ("beam 4.5", 400, "post", b'{"text": ["a"], "beam": 4.5}'),
        ("nbest above beam", 400, "post", b'{"text": ["a"], "beam": 2, "nbest": 3}'),
        ("alpha Infinity", 400, "post", b'{"text": ["a"], "alpha": Infinity}'),
        ("alpha NaN", 400, "post", b'{"text": ["a"], "alpha": NaN}'),
        ("alpha 1e308", 400, "post", b'{"text": ["a"], "alpha": 1e308}'),
        ("max_len_a 1e400", 400, "post", b'{"text": ["a"], "max_len_a": 1e400}'),
        ("max_len_b 10^9", 400, "post", b'{"text": ["a"], "max_len_b": 1000000000}'),
        ("max_len_b 10^399", 400, "post", b'{"text": ["a"], "max_len_b": 1' + b"0" * 399 + b"}"),
        ("seed -5", 400, "post", b'{"text": ["a"], "sample": true, "seed": -5}'),
        ("topk 10^50", 400, "post", b'{"text": ["a"], "sample": true, "topk": 1' + b"0" * 50 + b"}"),
        ("temperature 1e-300", 400, "post", b'{"text": ["a"], "sample": true, "temperature": 1e-300}'),
        ("a sentence of 100,000 characters", 400, "post", json.dumps({"text": ["a" * 100_000]}).encode()),
        ("300 sentences", 413, "post", many),
        ("256 sentences at beam 16", 413, "post", wide),
        ("beam 17, past --max-beam", 400, "post", b'{"text": ["a"], "beam": 17}'),
        ("min_len 100,000", 400, "post", json.dumps({**stall, "min_len": 100_000}).encode()),
        ("max_len_b 100,000", 400, "post", json.dumps(stall).encode()),
        ("a lone surrogate in text", 400, "post", b'{"text": ["a \\ud800"]}'),
        ("a lone surrogate in prefix", 400, "post", b'{"text": ["a"], "prefix": ["\\udfff b"]}'),
        ("a 1 MB body refused by its head", 413, "post", b'{"text": ["' + b"a" * (1 << 20) + b'"]}'),
        ("a body of 2 MB", 413, "post", b'{"text": ["' + b"a" * (2 << 20) + b'"]}'),
        ("a gzip body", 415, "gzip", ok),
        ("Content-Type text/plain", 415, "plain", ok),
        ("a foreign Host", 403, "host", ok),
        ("GET /translate", 405, "get", "/translate"),
        ("unknown path", 404, "get", "/nothing"),
    ]
    server = Server(served)
    wrong = []
    try:
        for name, want, how, what in cases:
            try:
                if how == "raw":
                    got = raw(server.port, what)
                elif how == "get":
                    got = urlopen_status(server.url + what)
                else:
                    headers = {
                        "gzip": {"Content-Encoding": "gzip"},
                        "plain": {"Content-Type": "text/plain"},  # a browser's CORS-free POST
                        "host": {"Host": "attacker.example:8080"},  # DNS rebinding
                        "post-bearer": {"Authorization": "bearer anything"},  # no key set: ignored
                    }.get(how, {})
                    got = post(server.url, what, **headers)[0]
            except Exception as e:  # noqa: BLE001 - reported as a failure of the case
                got = repr(e)
            if got != want:
                wrong.append(f"{name}: {got}, not {want}")
        health = urlopen_status(server.url + "/health")
        status, answer = post(server.url, ok)
        right = status == 200 and answer["translations"] == [expected[s] for s in probe]
        alive = server.proc.poll() is None
    finally:
        server.stop()
    row = {
        "part": "hostile requests",
        "cases": len(cases),
        "right_status": len(cases) - len(wrong),
        "wrong": wrong,
        "health_after": health,
        "honest_after_right": right,
        "alive": alive,
    }
    print(json.dumps(row), flush=True)


def urlopen_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def sigterm(served: Path, requests, expected, clients: int) -> None:
    server = Server(served)
    result: dict = {}
    sender = threading.Thread(target=lambda: result.update(load(server.url, requests, expected, clients)))
    sender.start()
    time.sleep(3.0)
    gone_s = server.stop()
    sender.join()
    row = {
        "part": "SIGTERM under load",
        "answered": len(result["latencies"]),
        "refused": len(result["refused"]),
        "lost": len(result["lost"]),
        "lost_examples": result["lost"][:3],
        "unlike_nmt_translate": result["wrong"],
        "process_gone_after_s": round(gone_s, 1),
        "exit_code": server.proc.returncode,
    }
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path, help="a run directory with a trained, averaged model")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--stalled", type=int, default=500)
    ap.add_argument("--unread", type=int, default=1000)
    ap.add_argument("--ct2", choices=["float32", "int8"], help="a CTranslate2 export instead")
    ap.add_argument(
        "--parts",
        nargs="*",
        default=["honest", "greedy", "costly", "stalled", "hostile", "unread", "sigterm"],
    )
    ap.add_argument(
        "--server-option", action="append", default=[], help="an option of `nmt serve` for every server"
    )
    ap.add_argument("--before", help="a git revision: the honest load alternated with its server")
    ap.add_argument("--before-run", type=Path, help="RUN as --before's code reads it (default: RUN)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--attacked-requests", type=int, default=120, help="the honest load of lockout, long")
    ap.add_argument("--attacked-clients", type=int, default=4)
    args = ap.parse_args()
    SERVER_OPTIONS.extend(o for option in args.server_option for o in option.split())
    work = Path(tempfile.mkdtemp(prefix="nmt-serve-load-"))
    try:
        models = exports(args.run, work, ct2=bool(args.ct2))
        served = models[args.ct2] if args.ct2 else models["package"]
        pool = split_files(args.run, "valid")[0].read_text(encoding="utf-8").splitlines()[:500]
        (work / "pool.txt").write_text("\n".join(pool) + "\n", encoding="utf-8")
        # the answers expected are the same engine's (--server-option "--engine nmt")
        engine = (
            SERVER_OPTIONS[SERVER_OPTIONS.index("--engine") : SERVER_OPTIONS.index("--engine") + 2]
            if ("--engine" in SERVER_OPTIONS)
            else []
        )
        nmt("translate", "--model", str(served), *engine, stdin=work / "pool.txt", stdout=work / "pool.out")
        expected = dict(zip(pool, (work / "pool.out").read_text(encoding="utf-8").split("\n")))
        rng = random.Random(0)
        requests = [rng.sample(pool, rng.randint(1, 8)) for _ in range(args.requests)]
        print(
            f"cpu: {cpu_name()}; model {served.name}; {args.clients} clients, {len(requests)} "
            f"requests, {sum(map(len, requests))} sentences; serve {' '.join(SERVER_OPTIONS)}",
            flush=True,
        )
        if args.before:
            before(served, requests, expected, args, pool)
            return
        baseline = None
        if {"honest", "greedy", "costly"} & set(args.parts):
            baseline = honest(served, requests, expected, args.clients)
        if "greedy" in args.parts:
            greedy(served, requests, expected, args.clients, pool, baseline)
        if "costly" in args.parts:
            costly(served, requests, expected, args.clients, pool, baseline)
        if "stalled" in args.parts:
            stalled(served, args.stalled, pool[:3], expected)
        if "hostile" in args.parts:
            hostile(served, pool[:3], expected)
        if "unread" in args.parts:
            unread(served, args.unread, pool[:3], expected)
        if "sigterm" in args.parts:
            sigterm(served, requests, expected, args.clients)
        attacks(served, ROOT, "this tree", args, pool, expected)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
