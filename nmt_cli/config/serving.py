"""`nmt serve`'s settings: where it listens, how it batches, what one request and client may ask
of it (how each is decoded: translation.py's DecodeOptions and TranslateConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from nmt_cli.config.common import knob
from nmt_cli.config.translation import RANGES
from nmt_cli.errors import NmtError


@dataclass(frozen=True)
class ServeConfig:
    host: str = knob("127.0.0.1", "Address to listen on.")
    port: int = knob(8080, "TCP port (0: any free one, printed).")
    max_wait_ms: float = knob(5.0, "How long a request may wait for others to share its batch.")
    max_batch: int = knob(64, "Sentences decoded together at most.")
    batching: bool = knob(True, "Decode concurrent requests together.")
    max_queue: int = knob(
        1024,
        "Work waiting at most, in sentences of 32 pieces at the default options (a sentence counts "
        "its hypotheses x its output limit: a longer or wider one more, a blank one nothing); "
        "beyond, 503.",
    )
    max_sentences: int = knob(256, "Sentences per request; beyond, 413.")
    max_hypotheses: int = knob(2048, "Sentences x beam per request (the work it asks for); beyond, 413.")
    max_output_len: int = knob(
        0,
        "Output tokens per sentence at most, whatever a request asks: a request's max_len defaults "
        "to it; a max_len, min_len or max_len_b above it gets 400 (0: the model's limit).",
    )
    max_beam: int = knob(
        16, "Beam (or n-best when sampling, or --mbr's candidates) of a request at most; beyond, 400."
    )
    max_memory: int = knob(
        0,
        "MiB that the searches being decoded may hold (their caches and alignments, as estimated "
        "from each sentence's length and options): a batch waits for room; a request with one "
        "sentence over it alone gets 413 (0: half the memory the machine has available once the "
        "model is loaded, at least 256 MiB).",
    )
    concurrent_batches: int = knob(
        0,
        "Batches decoded at once: nmt's engine takes their steps in turn by the time each has used "
        "(on a CPU), CTranslate2's workers decode them side by side; a request that arrives while "
        "a costly one decodes is not held up by it (0: nmt's engine 1, or with --running-batch two "
        "per CPU thread; CTranslate2 its workers, one per CPU thread or GPU).",
    )
    running_batch: bool = knob(
        True,
        "nmt's engine on a CPU: a request joins a running batch of its options (one per CPU thread) at "
        "its next decoding step and each sentence leaves it as it ends, or as its client goes "
        "(iteration-level scheduling); requests "
        "whose search cannot take sentences midway (sampling, --mbr, prefixes, constraints, "
        "no_repeat_ngram, the coverage penalty, alignments) decode in batches of their own.",
    )
    max_chars: int = knob(2000, "Characters per sentence, prefix or constraint; beyond, 400.")
    max_body: int = knob(1 << 20, "Bytes of a request's body; beyond, 413 (refused before it is read).")
    shutdown_timeout: float = 60.0  # seconds SIGTERM waits for requests in flight
    request_timeout: float = knob(
        60.0, "Seconds a request may wait and decode; beyond, 504 and it leaves the queue."
    )
    read_timeout: float = knob(
        30.0, "Seconds to receive a request's body; beyond, 408 (a client that stalls)."
    )
    header_timeout: float = knob(
        10.0,
        "Seconds a connection may stay without a request (its head must arrive whole within "
        "them); beyond, it is closed.",
    )
    max_connections: int = knob(1000, "Connections open at once; beyond, a new one gets 503 and is closed.")
    max_connections_per_client: int = knob(
        0,
        "Connections open at once from one client address; beyond, 503 (0: no cap, as behind a "
        "proxy, whose connections all come from one address).",
    )
    api_key: str = knob(
        "",
        "Require `Authorization: Bearer KEY` on every route but /health (better from the environment, "
        "NMT_API_KEY, than from a command line others can read).",
    )
    write_timeout: float = knob(
        30.0, "Seconds a client may leave its answer unread; beyond, its connection is aborted."
    )

    def __post_init__(self) -> None:
        for name in (
            "max_batch",
            "max_queue",
            "max_sentences",
            "max_hypotheses",
            "max_chars",
            "max_body",
            "max_connections",
            "max_beam",
        ):
            if getattr(self, name) < 1:
                raise NmtError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.max_output_len <= RANGES["max_len"][1]:
            raise NmtError(f"--max-output-len must be from 0 to {RANGES['max_len'][1]}")
        if self.max_wait_ms < 0 or not 0 <= self.port < 65536:
            raise NmtError("--max-wait-ms must not be negative, and --port within 0-65535")
        if min(self.request_timeout, self.read_timeout, self.header_timeout, self.write_timeout) <= 0:
            raise NmtError(
                "--request-timeout, --read-timeout, --header-timeout and --write-timeout must be positive"
            )
        if self.concurrent_batches < 0:
            raise NmtError("--concurrent-batches must not be negative (0: the engine's own)")
        if self.max_memory < 0:
            raise NmtError("--max-memory must not be negative (0: half of what the machine has available)")
        if self.max_connections_per_client < 0:
            raise NmtError("--max-connections-per-client must not be negative (0: no cap)")
