"""The real download code against a loopback HTTP server that breaks off and honours Range."""

import hashlib
import http.server
import threading

import pytest

from nmt_cli.data import fetch
from nmt_cli.data.fetch import Source
from nmt_cli.errors import NmtError

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB


class Server(http.server.ThreadingHTTPServer):
    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests: list[str | None] = []
        self.break_first = True


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        server: Server = self.server  # type: ignore[assignment]
        if self.path == "/endless.tgz":  # no length, and a body that never ends
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(PAYLOAD)
            except OSError:  # the client hung up
                return
        if self.path == "/badlength.tgz":
            self.send_response(200)
            self.send_header("Content-Length", "a lot")
            self.end_headers()
            self.wfile.write(PAYLOAD)
            self.close_connection = True
            return
        if self.path != "/data.tgz":
            self.send_error(404)
            return
        rng = self.headers.get("Range")
        server.requests.append(rng)
        start = int(rng.split("=")[1].rstrip("-")) if rng else 0
        body = PAYLOAD[start:]
        self.send_response(206 if rng else 200)
        self.send_header("Content-Length", str(len(body)))
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(PAYLOAD) - 1}/{len(PAYLOAD)}")
        self.end_headers()
        if server.break_first:  # the connection drops a third of the way in
            server.break_first = False
            self.wfile.write(body[: len(body) // 3])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


@pytest.fixture
def server():
    s = Server()
    thread = threading.Thread(target=s.serve_forever, daemon=True)
    thread.start()
    yield s
    s.shutdown()
    s.server_close()


def source(server, sha=None, path="data.tgz"):
    url = f"http://127.0.0.1:{server.server_address[1]}/{path}"
    return Source(url, sha or hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD))


def test_broken_download_resumes_with_range(server, tmp_path):
    path = fetch.fetch(source(server), tmp_path, wait=0)
    assert path.read_bytes() == PAYLOAD
    assert server.requests[0] is None
    assert server.requests[1] is not None and server.requests[1].startswith("bytes=")
    assert int(server.requests[1][6:-1]) > 0  # resumed, not restarted
    assert not (tmp_path / "data.tgz.part").exists()


def test_checksum_mismatch_keeps_the_file_aside(server, tmp_path):
    server.break_first = False
    with pytest.raises(NmtError, match="checksum mismatch"):
        fetch.fetch(source(server, sha="0" * 64), tmp_path, wait=0)
    assert not (tmp_path / "data.tgz").exists()
    assert (tmp_path / "data.tgz.bad").read_bytes() == PAYLOAD


def test_http_error_is_clear(server, tmp_path):
    with pytest.raises(NmtError, match="HTTP 404"):
        fetch.fetch(source(server, path="missing.tgz"), tmp_path, wait=0)


def test_unreachable_host_gives_up_after_retries(tmp_path):
    dead = Source("http://127.0.0.1:9/none.tgz", "0" * 64)
    with pytest.raises(NmtError, match="after 2 tries"):
        fetch.fetch(dead, tmp_path, retries=2, wait=0)


def test_a_body_that_never_ends_is_cut_at_the_expected_size(server, tmp_path, monkeypatch):
    with pytest.raises(NmtError, match=f"sent more than the {len(PAYLOAD)} bytes expected"):
        fetch.fetch(source(server, path="endless.tgz"), tmp_path, wait=0)
    assert not list(tmp_path.iterdir())  # nothing kept
    monkeypatch.setattr(fetch, "MAX_UNSIZED", 3 * len(PAYLOAD))  # no size pinned: the cap
    unsized = Source(source(server, path="endless.tgz").url, "0" * 64)
    with pytest.raises(NmtError, match=f"sent more than the {3 * len(PAYLOAD)} bytes expected"):
        fetch.fetch(unsized, tmp_path, wait=0)


def test_a_content_length_that_is_not_a_number_is_ignored(server, tmp_path):
    assert fetch.fetch(source(server, path="badlength.tgz"), tmp_path, wait=0).read_bytes() == PAYLOAD


def test_a_full_disk_is_one_line_naming_the_folder_not_a_retry(server, tmp_path, monkeypatch):
    import os
    import shutil
    from collections import namedtuple

    server.break_first = False
    (tmp_path / "data.tgz.part").symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(NmtError, match=f"{tmp_path} is full"):
        fetch.fetch(source(server), tmp_path, wait=0)
    assert len(server.requests) == 1  # not retried
    os.unlink(tmp_path / "data.tgz.part")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(NmtError, match=f"{tmp_path} has 0.0 GiB free; data.tgz needs"):
        fetch.fetch(source(server), tmp_path, wait=0)
    assert len(server.requests) == 1  # refused before asking


def test_a_mirror_url_serves_every_pinned_file_by_its_name(server, tmp_path, monkeypatch):
    """$NMT_MIRROR_URL: the file comes from there under its own name, its sha256 checked as
    ever; without it, from its origin."""
    server.break_first = False
    origin = Source(
        "http://127.0.0.1:9/somewhere/else/data.tgz", hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD)
    )
    monkeypatch.setenv(fetch.MIRROR_URL, f"http://127.0.0.1:{server.server_address[1]}/")
    assert fetch.fetch(origin, tmp_path / "a", wait=0).read_bytes() == PAYLOAD
    with pytest.raises(NmtError, match="checksum mismatch"):
        fetch.fetch(Source(origin.url, "0" * 64), tmp_path / "b", wait=0)
    monkeypatch.delenv(fetch.MIRROR_URL)
    with pytest.raises(NmtError, match="127.0.0.1:9/somewhere"):
        fetch.fetch(origin, tmp_path / "c", retries=1, wait=0)
