"""The decoding queue of `nmt serve`: requests gathered into batches by one decoding thread,
the requests served least first, large ones in pieces; each request's answers in order."""

from __future__ import annotations

import asyncio
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from nmt_cli import ui
from nmt_cli.config import DecodeOptions, ServeConfig
from nmt_cli.errors import Stopped
from nmt_cli.translator import Translator


@dataclass(eq=False)  # a job is itself: the queue finds and removes it by identity
class Job:
    sentences: list[str]
    options: DecodeOptions
    prefixes: list[str] | None
    constraints: list[list[str]] | None
    done: asyncio.Future
    costs: list[int]  # each sentence's work (Translator.work): what it holds of the queue
    arrived: float = field(default_factory=time.monotonic)
    taken: int = 0  # sentences handed to the decoder so far
    answers: list = field(default_factory=list)  # the answers of the pieces decoded, in order


Piece = tuple[Job, int, int]  # a job's sentences [lo, hi) in one decoding batch

# --max-queue counts sentences of this many pieces at the default options
TYPICAL = 32


class Batcher:
    """Gathers the sentences of concurrent requests into decoding batches, the requests served
    least first, large ones in pieces."""

    def __init__(self, translator: Translator, config: ServeConfig):
        self.translator, self.config = translator, config
        self.jobs: deque[Job] = deque()
        self.pending = 0  # sentences queued or being decoded
        # ... and their work (Translator.work: hypotheses x output limit), which --max-queue
        # bounds: that many sentences of TYPICAL pieces at the default options
        self.work = 0
        self.most_work = config.max_queue * translator.work_of([TYPICAL], translator.config.decode)[0]
        self.arrived = asyncio.Event()
        self.decoder = ThreadPoolExecutor(1, thread_name_prefix="nmt-decode")
        self.running = False  # the decoding loop takes work: submit refuses it otherwise
        self.stopped = 0  # batches given up midway: nobody waited for them any more

    def submit(
        self,
        sentences: list[str],
        options: DecodeOptions,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
    ) -> asyncio.Future | None:
        """The future of the job's answer, or None when the queue is full; OverflowError when the
        job alone is more work than the queue holds (it would never fit); RuntimeError when the
        decoding loop has stopped (nothing would ever answer it)."""
        if not self.running:
            raise RuntimeError("the decoding loop has stopped")
        costs = self.translator.work(sentences, options, prefixes, constraints)
        if sum(costs) > self.most_work:
            raise OverflowError(
                f"this request is {sum(costs) / self.most_work * self.config.max_queue:.0f} typical "
                f"sentences of work; the queue holds {self.config.max_queue} (--max-queue)"
            )
        if self.work + sum(costs) > self.most_work:
            return None
        job = Job(
            sentences, options, prefixes, constraints, asyncio.get_running_loop().create_future(), costs
        )
        self.jobs.append(job)
        self.pending += len(sentences)
        self.work += sum(costs)
        self.arrived.set()
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

    def _next(self) -> Job:
        """The job served least so far (then the oldest): a short request waits for at most the
        batch being decoded, however large the requests queued before it."""
        return min(self.jobs, key=lambda j: (j.taken, j.arrived))

    def _take(self) -> list[Piece]:
        """One decoding batch: pieces of the jobs with the next job's options (all but the seed
        and alpha, which each sentence keeps), least served first, up to `max_batch` sentences
        at the default beam (fewer at a wider beam, so that every batch is about as much work)."""
        first = self._next()
        budget = self.config.max_batch * self.translator.config.decode.rows  # hypotheses
        pieces: list[Piece] = []
        shared = first.options.shared()
        same = [j for j in self.jobs if j.options.shared() == shared]
        rows = first.options.rows
        for job in sorted(same, key=lambda j: (j.taken, j.arrived)):
            if pieces and (not self.config.batching or budget < rows):
                break
            n = min(len(job.sentences) - job.taken, max(1, budget // rows))
            pieces.append((job, job.taken, job.taken + n))
            job.taken += n
            budget -= n * rows
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
        """Decode batches for ever. An error in one batch fails that batch's requests, never the
        loop: a loop that ended would leave every later request unanswered."""
        self.running = True
        try:
            await self._loop()
        finally:
            self.running = False

    async def _loop(self) -> None:
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
            except Exception as e:  # noqa: BLE001 - a fault of ours: those requests get a 500
                ui.say("nmt serve: a batch failed: " + "".join(traceback.format_exception_only(e)).strip())
                for job, _, _ in pieces:
                    _settle(job, error=e)
            finally:
                for job, lo, hi in pieces:
                    self._done_with(job, lo, hi)

    async def _serve(self, pieces: list[Piece]) -> None:
        """Decode `pieces` as one batch and answer each job whose last piece this is; if the
        batch fails, each piece alone (a job whose piece fails gets the error and leaves). Jobs
        nobody waits for any more (client gone, deadline passed) are not decoded, and their rows
        stop at the next decoding step once they go."""
        pieces = [p for p in pieces if not p[0].done.done()]
        if not pieces:
            return
        loop = asyncio.get_running_loop()
        sentences = [s for job, lo, hi in pieces for s in job.sentences[lo:hi]]
        keys = [i for _, lo, hi in pieces for i in range(lo, hi)]  # each its place in its request
        prefixes = _joined([(job.prefixes, lo, hi) for job, lo, hi in pieces], "")
        constraints = _joined([(job.constraints, lo, hi) for job, lo, hi in pieces], [])
        options = [job.options for job, lo, hi in pieces for _ in range(lo, hi)]
        jobs = [job for job, lo, hi in pieces for _ in range(lo, hi)]  # each sentence's

        def gone() -> list[bool]:  # asked from the decoding thread between steps
            return [job.done.done() for job in jobs]

        try:
            texts, hyps = await loop.run_in_executor(
                self.decoder,
                self._decode,
                sentences,
                options,
                keys,
                prefixes,
                constraints,
                gone,
            )
        except Stopped:  # every client left or passed its deadline while it decoded
            self.stopped += 1
            return
        except Exception as e:  # noqa: BLE001 - a request the decoder fails on fails alone
            if len(pieces) > 1:
                for piece in pieces:
                    await self._serve([piece])
            else:
                self._fail(pieces[0][0], e)
            return
        start = 0
        for job, lo, hi in pieces:
            end = start + hi - lo
            try:  # one job's answer that cannot be made fails that job alone
                job.answers += _answer(texts[start:end], hyps[start:end], job.options)
            except Exception as e:  # noqa: BLE001 - its client gets a 500, the others their answers
                self._fail(job, e)
            else:
                if len(job.answers) == len(job.sentences):
                    _settle(job, answers=job.answers)
            start = end

    def _fail(self, job: Job, error: BaseException) -> None:
        """`job` fails (unless its client left or its deadline passed meanwhile); its other
        pieces are not decoded."""
        _settle(job, error=error)
        if job in self.jobs:
            self.jobs.remove(job)
            self._done_with(job, job.taken, len(job.sentences))

    def _decode(
        self, sentences: list[str], options: list[DecodeOptions], keys: list[int], prefixes, constraints, gone
    ):
        hyps = self.translator.hypotheses(sentences, options, keys, prefixes, constraints, gone)
        return self.translator.texts(hyps), hyps


def _settle(job: Job, answers: list | None = None, error: BaseException | None = None) -> None:
    """Answer `job`, unless it is answered already: its client left or its deadline passed (its
    future cancelled), or an earlier piece of it failed."""
    if job.done.done():
        return
    if error is not None:
        job.done.set_exception(error)
    else:
        job.done.set_result(answers)


def _joined(parts: list[tuple[list | None, int, int]], none) -> list | None:
    """The pieces' per-sentence lists (a job's prefixes, constraints) as one list for the batch,
    `none` for the sentences of jobs without one; None if no job has one."""
    if not any(given for given, _, _ in parts):
        return None
    return [x for given, lo, hi in parts for x in (given or [none] * hi)[lo:hi]]


def _answer(texts: list[list[str]], hyps, options: DecodeOptions) -> list:
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
