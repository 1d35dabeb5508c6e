"""The queue of `nmt serve`: the requests waiting (`Job`), the work and memory they hold, and who
is served first. serve/lanes.py runs the running batches over it, batcher.py the loop that
decodes it. Work is admitted while the memory its searches hold (Served.costs) fits
--max-memory."""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from nmt_cli.config import DecodeOptions, ServeConfig
from nmt_cli.serve.contract import Decoder


@dataclass(eq=False)  # a job is itself: the queue finds and removes it by identity
class Job:
    sentences: list[str]
    options: DecodeOptions
    prefixes: list[str] | None
    constraints: list[list[str]] | None
    done: asyncio.Future
    costs: list[int]  # each sentence's work (Served.costs): what it holds of the queue
    sizes: list[int]  # ... and the bytes its search holds while it decodes
    arrived: float = field(default_factory=time.monotonic)
    taken: int = 0  # sentences handed to the decoder so far
    flying: int = 0  # ... and not yet answered
    decoding: bool = False  # a piece of it is being decoded: its next waits (one at a time)
    holds: int = 0  # the bytes of its sentences in running batches (their `sizes`)
    long: bool = False  # a sentence of it is LONG typical sentences' work or more
    answers: list = field(init=False)  # each sentence's answer, as it comes
    answered: int = 0

    def __post_init__(self) -> None:
        self.answers = [None] * len(self.sentences)


Piece = tuple[Job, int, int]  # a job's sentences [lo, hi) in one decoding batch


# --max-queue counts sentences of this many pieces at the default options
TYPICAL = 32
# a sentence of this many typical sentences' work is long (CTranslate2's spare worker): beam 16
# with a limit of 328 tokens; at the default beam, none is
LONG = 16
# ... and so is one whose output may run this many typical sentences' steps (a min_len or
# max_len_b of hundreds, at any beam: steps are what a batch that cannot stop holds a worker for)
LONG_STEPS = 4
# seconds a request that does not fit the memory left is passed over by others that do; then
# nothing else begins until it fits
PATIENCE = 1.0


class Queue:
    """The requests queued or being decoded, their work and their memory, and their order. The
    loop's state it reads (set by Batcher): whether requests join running batches, the spare
    worker."""

    joins: bool
    spare: int

    def __init__(self, translator: Decoder, config: ServeConfig):
        self.translator, self.config = translator, config
        self.jobs: deque[Job] = deque()
        self.pending = 0  # sentences queued or being decoded
        # ... and their work (Served.costs: hypotheses x output limit), which --max-queue
        # bounds: that many sentences of TYPICAL pieces at the default options
        self.work = 0
        self.typical = translator.work_of([TYPICAL], translator.config.decode)[0]
        self.typical_steps = self.typical // translator.config.decode.rows
        self.most_work = config.max_queue * self.typical
        self.memory = memory_budget(config.max_memory)  # bytes the batches being decoded may hold
        self.held = 0
        self.changed = asyncio.Event()  # a job arrived or a batch ended
        self.running = False  # the decoding loop takes work: submit refuses it otherwise

    def submit(
        self,
        sentences: list[str],
        options: DecodeOptions,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
    ) -> asyncio.Future | None:
        """The future of the job's answer, or None when the queue is full; OverflowError when the
        job alone is more work than the queue holds, or one of its sentences more memory than
        --max-memory (it would never fit); RuntimeError when the decoding loop has stopped
        (nothing would ever answer it)."""
        if not self.running:
            raise RuntimeError("the decoding loop has stopped")
        costs, sizes = self.translator.costs(sentences, options, prefixes, constraints)
        if sum(costs) > self.most_work:
            raise OverflowError(
                f"this request is {sum(costs) / self.most_work * self.config.max_queue:.0f} typical "
                f"sentences of work; the queue holds {self.config.max_queue} (--max-queue)"
            )
        if max(sizes, default=0) > self.memory:
            raise OverflowError(
                f"a sentence of this request needs {max(sizes) / 2**20:.0f} MiB to decode; this server "
                f"decodes in {self.memory >> 20} MiB (--max-memory): ask for a narrower beam or a "
                "shorter output"
            )
        if self.work + sum(costs) > self.most_work:
            return None
        done = asyncio.get_running_loop().create_future()
        job = Job(sentences, options, prefixes, constraints, done, costs, sizes)
        steps = max(costs, default=0) // options.rows  # its output's limit
        job.long = bool(self.spare) and (
            max(costs, default=0) >= LONG * self.typical or steps >= LONG_STEPS * self.typical_steps
        )
        self.jobs.append(job)
        self.pending += len(sentences)
        self.work += sum(costs)
        self.changed.set()
        return job.done

    def withdraw(self, done: asyncio.Future) -> None:
        """The job of `done` leaves the queue undecoded (its client went away); a piece of it that
        is being decoded finishes, unanswered."""
        done.cancel()
        for job in self.jobs:
            if job.done is done:
                self.jobs.remove(job)
                self._done_with(job, job.taken, len(job.sentences))
                return

    def _done_with(self, job: Job, lo: int, hi: int) -> None:
        """Sentences [lo, hi) of `job` leave the queue: decoded, given up or withdrawn."""
        self.pending -= hi - lo
        self.work -= sum(job.costs[lo:hi])

    def _fail(self, job: Job, error: BaseException) -> None:
        """`job` fails (unless its client left or its deadline passed meanwhile); its other
        pieces are not decoded."""
        settle(job, error=error)
        if job in self.jobs:
            self.jobs.remove(job)
            self._done_with(job, job.taken, len(job.sentences))

    def _waiting(self) -> list[Job]:
        """The jobs that may join a batch: those with no piece being decoded (a large request's
        pieces go one after another, never taking every batch)."""
        return [j for j in self.jobs if not j.decoding]

    def _next(self) -> Job | None:
        """The waiting job to serve first (`_order`): a short request waits for at most the batch
        being decoded, however large the requests queued before it."""
        return min(self._waiting(), key=self._order, default=None)

    def _ordered(self) -> list[Job]:
        return sorted(self._waiting(), key=self._order)

    def _order(self, job: Job) -> tuple:
        return order(job, self.joins)

    def _starved(self, job: Job) -> bool:
        """Whether `job` has waited PATIENCE: what does not fit is passed over no longer."""
        return time.monotonic() - job.arrived >= PATIENCE

    def oldest_wait(self) -> float:
        """Seconds the oldest request with no sentence decoding has been queued."""
        now = time.monotonic()
        return max((now - job.arrived for job in self.jobs if not job.flying), default=0.0)


def memory_budget(mib: int, available: int | None = None) -> int:
    """--max-memory in bytes: `mib` as given, or (0) half of the memory the machine has
    available (`available` bytes, default: read now, with the model loaded), at least 256 MiB:
    the searches' estimate does not count the process's own (the model, the interpreter, the
    allocator's arenas), hence the half."""
    if mib:
        return mib << 20
    if available is None:
        available = _available_bytes()
    return max(available // 2, 256 << 20)


def _available_bytes() -> int:
    """What the machine can still give (Linux's MemAvailable; elsewhere its free pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 2 << 30


def settle(job: Job, answers: list | None = None, error: BaseException | None = None) -> None:
    """Answer `job`, unless it is answered already: its client left or its deadline passed (its
    future cancelled), or an earlier piece of it failed."""
    if job.done.done():
        return
    if error is not None:
        job.done.set_exception(error)
    else:
        job.done.set_result(answers)


def within(sizes: list[int], room: int, first: bool) -> int:
    """How many of `sizes`, from the first, fit in `room` (at least one if `first`: a batch
    always takes something)."""
    total = 0
    for n, size in enumerate(sizes):
        total += size
        if total > room:
            return max(n, 1) if first else n
    return len(sizes)


def answer_of(texts: list[list[str]], hyps, options: DecodeOptions) -> list:
    """Each sentence's translation: its text; with "scores" or "alignments", an object with
    "text" and those; with nbest > 1, a list of these, best first."""
    if options.nbest == 1 and not options.scores and not options.alignments:
        return [t[0] for t in texts]

    def one(text: str, h) -> dict:
        answer: dict = {"text": text}
        if options.scores or options.nbest > 1:
            answer["score"] = round(h.score, 4)
        if options.alignments:
            answer["alignment"] = h.alignment or ""
        return answer

    found = [[one(t, h) for t, h in zip(ts, hs)] for ts, hs in zip(texts, hyps)]
    return found if options.nbest > 1 else [f[0] for f in found]


def order(job: Job, running: bool) -> tuple:
    """Who is served first. Batch by batch: the request served least so far. With running
    batches (`running`), which free room a sentence at a time: the request whose sentences hold
    the fewest bytes in them, then the oldest (a newcomer is never behind a large request's next
    sentences, and a request of long sentences, which hold much, never ahead of short ones; a
    connection sends one request at a time, so connections are served alike)."""
    return (job.holds, job.arrived) if running else (job.taken, job.arrived)


@dataclass(frozen=True)
class Load:
    """What is being decoded, as admission sees it: the searches, those that hold a slot (all but
    the running batches that take no sentences), the long batches among them, and the bytes
    they hold."""

    searches: int
    busy: int
    long_batches: int
    held: int


def fits(job: Job, load: Load, at_once: int, most: int, spare: int, memory: int) -> bool:
    """Whether another batch may begin with `job`: a batch of its kind is free (long batches: the
    spare, and up to half of the `at_once` others), fewer than `most` searches (or `at_once`)
    and the spare run, and its next sentence's memory fits beside what is held."""
    if job.long:
        free = load.long_batches < max(1, at_once // 2)
    else:
        free = load.busy - load.long_batches < at_once
    return free and load.searches < max(at_once, most) + spare and load.held + job.sizes[job.taken] <= memory


def ready(first: Job, jobs: Iterable[Job], config: ServeConfig, now: float) -> bool:
    """Whether a batch begins now with `first`: batching is off, or enough sentences are queued
    to fill one, or `first` has waited --max-wait-ms."""
    queued = sum(len(j.sentences) - j.taken for j in jobs)
    waited = now - first.arrived
    return not config.batching or queued >= config.max_batch or waited * 1000 >= config.max_wait_ms
