"""The decoding queue of `nmt serve`: requests gathered into batches, large ones in pieces; each
request's answers in order. nmt's engine on a CPU schedules step by step: a request joins a
running batch of its options at its next step and each sentence leaves it as it ends
(Translator.running, one per CPU thread); running batches and the batches of the requests that
cannot join one take their steps in turn (turns.py). Elsewhere batches are decoded whole, the
requests served least first, one at a time or, with --concurrent-batches, several taking turns
step by step. CTranslate2 cannot share its steps: its batches are cut to a bounded cost, and its
workers decode several side by side; on a CPU, a batch of long sentences goes to a spare worker
(a batch cannot be stopped midway: one that decodes for minutes would hold a worker the others
need). Work is admitted while the memory its searches hold (Translator.costs) fits
--max-memory."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from nmt_cli import ui
from nmt_cli.config import DecodeOptions, ServeConfig
from nmt_cli.engine.hypothesis import Hypothesis
from nmt_cli.errors import Stopped
from nmt_cli.serve.turns import Turns
from nmt_cli.translator import Translator


@dataclass(eq=False)  # a job is itself: the queue finds and removes it by identity
class Job:
    sentences: list[str]
    options: DecodeOptions
    prefixes: list[str] | None
    constraints: list[list[str]] | None
    done: asyncio.Future
    costs: list[int]  # each sentence's work (Translator.costs): what it holds of the queue
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


@dataclass(eq=False)
class Stream:
    """The running batch of nmt's engine (Translator.running): the options its sentences share,
    its search, the pieces handed to it that join at its next step, the hypotheses it holds
    (the loop's count), and whether it still takes pieces (its thread ends when it has none)."""

    options: DecodeOptions
    lane: int
    search: Any
    inbox: deque[Piece] = field(default_factory=deque)
    rows: int = 0
    open: bool = True
    total: int = 0  # sentences handed to it so far
    oldest: int = 0  # the steps its longest-running live sentence has taken (its thread's count)
    draining: bool = False  # it takes no more sentences: its slot goes to options that have none
    began: float = field(default_factory=time.monotonic)
    # the bytes of each sentence it holds, and what they hold together: each row of a running
    # batch is as wide as its longest (the caches are padded to the longest source and output)
    sizes: dict[tuple[int, int], int] = field(default_factory=dict)
    held: int = 0

    @property
    def takes(self) -> bool:
        return self.open and not self.draining and self.total < RENEW

    def holding(self, extra: Sequence[int] = ()) -> int:
        """What its sentences hold with `extra` ones beside them: each at the widest's size."""
        every = [*self.sizes.values(), *extra]
        return len(every) * max(every, default=0)


# --max-queue counts sentences of this many pieces at the default options
TYPICAL = 32
# sentences a running batch takes before it ends and another takes its place
RENEW = 100_000
# once a sentence has run this many times the median sentence's steps (of the last LASTED to
# end), the lane that holds the longest-running one takes no sentences while another can
LONGER, LASTED = 1.5, 256
# a sentence of this many typical sentences' work is long (CTranslate2's spare worker): beam 16
# with a limit of 328 tokens; at the default beam, none is
LONG = 16
# ... and so is one whose output may run this many typical sentences' steps (a min_len or
# max_len_b of hundreds, at any beam: steps are what a batch that cannot stop holds a worker for)
LONG_STEPS = 4
# seconds a request that does not fit the memory left is passed over by others that do; then
# nothing else begins until it fits
PATIENCE = 1.0


class Batcher:
    """Gathers the sentences of concurrent requests into decoding batches, the requests served
    least first, large ones in pieces."""

    def __init__(self, translator: Translator, config: ServeConfig):
        self.translator, self.config = translator, config
        self.jobs: deque[Job] = deque()
        self.pending = 0  # sentences queued or being decoded
        # ... and their work (Translator.costs: hypotheses x output limit), which --max-queue
        # bounds: that many sentences of TYPICAL pieces at the default options
        self.work = 0
        self.typical = translator.work_of([TYPICAL], translator.config.decode)[0]
        self.typical_steps = self.typical // translator.config.decode.rows
        self.most_work = config.max_queue * self.typical
        self.memory = memory_budget(config.max_memory)  # bytes the batches being decoded may hold
        self.held = 0
        # nmt's engine asks `gone` before each step, where a batch waits for its turn
        # CTranslate2's workers (one per CPU thread) decode its batches side by side, each whole
        apart = translator.engine == "ctranslate2"
        backend = getattr(translator, "backend", None)
        own = getattr(backend, "workers", 1) if apart else 1  # 0: its own
        # ... and a spare worker (CPU) that only batches of long sentences take, up to half of
        # what decodes at once: long batches share the cores with the others, never hold them up
        self.spare = getattr(backend, "spare", 0) if apart else 0
        self.long_batches = 0  # long batches being decoded
        # nmt's engine on a CPU: requests whose search can take sentences midway join a running
        # batch of their options at its next step (Translator.running), one per CPU thread (its
        # lanes: a step's matrices are too small for threads to share one well); the running
        # batches and the batches of the others step in turn, a thread each
        self.joins = (
            config.running_batch
            and config.batching
            and callable(getattr(translator, "running", None))
            and translator.steps_in_turn()
        )
        self.lanes = translator.slots() if self.joins else 1
        # Options whose running batches hold every slot would lock the others out for as long
        # as their clients send (a batch ends only when empty): the first waiting request whose
        # options have no batch that takes sentences makes another one stop taking them, the
        # one whose longest sentence has run longest, and begins beside it; that one ends when
        # its sentences do. So at most `most` searches, half of them emptying.
        self.most = 0
        if self.joins:
            self.at_once = config.concurrent_batches or 2 * self.lanes
            self.most = 2 * self.at_once
            self.stepped, slots, threads = True, self.lanes, 1
        else:
            self.at_once = (config.concurrent_batches or own) if translator.steps_in_turn() or apart else 1
            self.stepped = self.at_once > 1 and not apart
            # with several searches at once, each on one thread (not slots x all of them)
            slots, threads = (translator.slots(), 1) if self.stepped else (1, 0)
        self.cut = translator.engine != "nmt"  # batches that cannot share their steps
        self.turns = Turns(slots)
        if self.stepped and hasattr(translator, "backend"):
            # nmt's backend: each search in its caller's thread (no worker thread holding a
            # turn it no longer uses)
            cast(Any, translator.backend).caller_threads = threads
        self.batch_ids = itertools.count()
        self.decoding: set[asyncio.Task] = set()  # the batches being decoded
        self.busy: set[Future] = set()  # ... in their threads, which may outlive their tasks
        self.changed = asyncio.Event()  # a job arrived or a batch ended
        threads_needed = max(self.at_once, self.most) + self.spare
        self.decoder = ThreadPoolExecutor(threads_needed, thread_name_prefix="nmt-decode")
        self.running = False  # the decoding loop takes work: submit refuses it otherwise
        # batches given up midway, and steps at which sentences left the running batch
        # unfinished: nobody waited for them any more
        self.stopped = 0
        # the running batches, by their options and lane
        self.streams: dict[tuple[DecodeOptions, int], Stream] = {}
        self.lasted: deque[int] = deque(maxlen=LASTED)  # the steps of the sentences that ended last
        self.lock = threading.Lock()  # the stream's inbox and end, between the loop and its thread

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
        """Who is served first. Batch by batch: the request served least so far. With running
        batches, which free room a sentence at a time: the request whose sentences hold the
        fewest bytes in them, then the oldest (a newcomer is never behind a large request's
        next sentences, and a request of long sentences, which hold much, never ahead of short
        ones; a connection sends one request at a time, so connections are served alike)."""
        if not self.joins:
            return (job.taken, job.arrived)
        return (job.holds, job.arrived)

    def _busy(self) -> int:
        """The searches that hold a slot: all but the running batches that take no sentences."""
        return len(self.decoding) - sum(not s.takes for s in self.streams.values())

    def _fits(self, first: Job) -> bool:
        """Whether another batch may begin with `first`: a batch of its kind is free (long
        batches: the spare, and up to half of the others) and its next sentence's memory fits
        beside what the batches being decoded hold."""
        if first.long:
            free = self.long_batches < max(1, self.at_once // 2)
        else:
            free = self._busy() - self.long_batches < self.at_once
        return (
            free
            and len(self.decoding) < max(self.at_once, self.most) + self.spare
            and self.held + first.sizes[first.taken] <= self.memory
        )

    def _starved(self, job: Job) -> bool:
        """Whether `job` has waited PATIENCE: what does not fit is passed over no longer."""
        return time.monotonic() - job.arrived >= PATIENCE

    def _make_room(self, key: DecodeOptions | None) -> bool:
        """The first waiting request has no running batch of its options (`key`; None: it is
        decoded in a batch of its own) that takes sentences, and every slot is held: the running
        batch of other options whose longest sentence has run longest stops taking sentences
        (it ends when they do, and its slot is free at once), while fewer than `most` searches
        run. Whether one did."""
        if not self.joins or len(self.decoding) >= self.most or self._busy() < self.at_once:
            return False
        others = [s for s in self.streams.values() if s.takes and s.options != key]
        if not others:
            return False
        max(others, key=lambda s: (s.oldest, -s.began)).draining = True
        return True

    def oldest_wait(self) -> float:
        """Seconds the oldest request with no sentence decoding has been queued."""
        now = time.monotonic()
        return max((now - job.arrived for job in self.jobs if not job.flying), default=0.0)

    def _take(self, first: Job) -> list[Piece]:
        """One decoding batch: pieces of the jobs with the next job's options (all but the seed
        and alpha, which each sentence keeps), least served first, up to `max_batch` sentences
        at the default beam (fewer at a wider beam, so that every batch is about as much work),
        as many as the memory left holds. A batch that cannot share its steps (CTranslate2) is
        also cut to `max_batch` typical sentences' work: a long request goes in pieces that take
        their turn with the others'."""
        budget = self.config.max_batch * self.translator.config.decode.rows  # hypotheses
        work = self.most_work // self.config.max_queue * self.config.max_batch if self.cut else None
        room = self.memory - self.held
        pieces: list[Piece] = []
        shared = first.options.shared()
        same = [j for j in self._waiting() if j.options.shared() == shared and j.long == first.long]
        rows = first.options.rows
        for job in sorted(same, key=lambda j: (j is not first, self._order(j))):
            if pieces and (not self.config.batching or budget < rows):
                break
            n = min(len(job.sentences) - job.taken, max(1, budget // rows))
            n = _within(job.sizes[job.taken : job.taken + n], room, first=not pieces)
            if work is not None:
                n = min(n, _within(job.costs[job.taken : job.taken + n], work, first=not pieces))
            if not n:  # passed over while it has waited less than PATIENCE; then it waits first
                if self._starved(job):
                    break
                continue
            room -= sum(job.sizes[job.taken : job.taken + n])
            if work is not None:
                work -= sum(job.costs[job.taken : job.taken + n])
            pieces.append((job, job.taken, job.taken + n))
            job.taken += n
            job.flying += n
            budget -= n * rows
            if job.taken == len(job.sentences):
                self.jobs.remove(job)
        return pieces

    def _ready(self, first: Job) -> bool:
        waited = time.monotonic() - first.arrived
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
            for task in self.decoding:
                task.cancel()

    async def drained(self) -> None:
        """Wait, without holding the event loop, for the batches still decoding in their threads
        (CTranslate2's cannot be stopped midway)."""
        await asyncio.gather(*(asyncio.wrap_future(f) for f in list(self.busy)), return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            while (first := self._next()) is None:
                self.changed.clear()
                await self.changed.wait()
            if self._joinable(first):
                first = self._fed()
                if first is None:
                    continue
                if self._joinable(first):  # until a sentence or batch ends or a job arrives
                    self.changed.clear()
                    await self.changed.wait()
                    continue
            while first is not None and not self._ready(first):
                self.changed.clear()
                left = self.config.max_wait_ms / 1000 - (time.monotonic() - first.arrived)
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout=max(left, 0.0))
                except asyncio.TimeoutError:
                    pass
                first = self._next()
                if first is not None and self._joinable(first):  # the first of those in batches
                    first = next((j for j in self._ordered() if not self._joinable(j)), None)
            if first is None:
                continue
            if not self._fits(first):
                first = self._instead(first)
            if not self._fits(first):  # until a batch ends or a job arrives
                self.changed.clear()
                await self.changed.wait()
                continue
            pieces = self._take(first)
            for job, _, _ in pieces:
                job.decoding = True
            held = sum(sum(job.sizes[lo:hi]) for job, lo, hi in pieces)
            self.held += held
            self.long_batches += first.long
            task = asyncio.get_running_loop().create_task(self._batch(pieces, held, first.long))
            self.decoding.add(task)
            if self.at_once + self.spare == 1:  # one batch at a time
                await asyncio.wait([task])

    def _instead(self, first: Job) -> Job:
        """What may begin where `first` may not: with every slot held, first makes room if it
        is the first in line (`_make_room`); else a job of the other kind (CTranslate2's spare
        worker) or, while first has waited less than PATIENCE, one that fits the memory left."""
        ordered = self._ordered()
        if ordered and ordered[0] is first and self._make_room(None) and self._fits(first):
            return first
        if self.spare:
            other = next((j for j in ordered if j.long != first.long), None)
            if other is not None and self._fits(other):
                return other
        if not self._starved(first):
            return next((j for j in ordered if not self._joinable(j) and self._fits(j)), first)
        return first

    def _joinable(self, job: Job) -> bool:
        return (
            self.joins
            and not any(job.prefixes or [])
            and not any(job.constraints or [])
            and self.translator.joins(job.options)
        )

    def _fed(self) -> Job | None:
        """Feed the running batches, in `_order`, a running batch of the first waiting job whose
        options have room (None: done); a job whose running batches have none does not hold up
        those of other options. Else the first waiting job that must be decoded in a batch of
        its own (the loop begins one if it can), or the first job (nothing can begin now)."""
        waiting = self._ordered()
        tried = set()
        for job in waiting:
            if not self._joinable(job):
                return job
            key = job.options.joint()
            if key not in tried:
                tried.add(key)
                if self._feed(job):
                    return None
                # the first in line, whose options have no batch that takes sentences
                if job is waiting[0] and self._make_room(key) and self._feed(job):
                    return None
        return waiting[0]

    def _feed(self, first: Job) -> bool:
        """Hand a running batch of `first`'s options the sentences that fit beside its rows: a
        lane of its own if one is unused, the others busy and a batch free, else the lane with
        the fewest rows; of the waiting jobs with its options, in `_order`, while its hypotheses
        stay within its share of `max_batch` sentences at the default beam and their memory
        within --max-memory (one sentence at least when it holds none). Whether any was
        handed."""
        key = first.options.joint()
        lanes = [self.streams.get((key, lane)) for lane in range(self.lanes)]
        # a running batch keeps a little of each sentence it took (its limit, alpha, first step):
        # past RENEW it takes no more, ends, and a new one takes its lane
        taking = [s for s in lanes if s is not None and s.takes]
        # A sentence that decodes long pays its lane's whole step at each of its steps: while one
        # runs, its lane takes no sentences if another lane can, so that its steps get cheaper as
        # the others end, as at the end of a batch (only one lane: new sentences always have one)
        if len(taking) > 1 and self.lasted:
            longest = max(taking, key=lambda s: s.oldest)
            if longest.oldest > LONGER * float(np.median(self.lasted)):
                taking.remove(longest)
        fewest = min(((s.rows, s.lane) for s in taking), default=None)
        unused = [lane for lane, s in enumerate(lanes) if s is None]
        # a new lane only for a sentence that fits (an empty one would end at once, and the
        # next pass begin another)
        fits = not self.held or any(
            self.held + j.sizes[j.taken] <= self.memory
            for j in self._waiting()
            if j.options.joint() == key and self._joinable(j)
        )
        if (
            unused
            and fits
            and (fewest is None or fewest[0])
            and self._busy() < self.at_once
            and len(self.decoding) < self.most
        ):
            try:
                search = self.translator.running(first.options)
            except Exception as e:  # noqa: BLE001 - a fault of ours: that request gets a 500
                self._fail(first, e)
                return True
            s = self.streams[key, unused[0]] = Stream(key, unused[0], search)
            task = asyncio.get_running_loop().create_task(self._streaming(s))
            self.decoding.add(task)
        elif fewest is not None:
            s = self.streams[key, fewest[1]]
        else:
            return False
        sentences = max(1, self.config.max_batch // self.lanes)  # each lane's share
        budget = sentences * self.translator.config.decode.rows - s.rows
        room = self.memory - self.held
        pieces: list[Piece] = []
        joining: list[int] = []  # the sizes of the sentences handed to it now
        with self.lock:
            if not s.open:  # its thread is ending: a new one begins when it has
                return False
            for job in self._ordered():
                if job.options.joint() != s.options or not self._joinable(job):
                    continue
                rows = job.options.rows
                n = min(len(job.sentences) - job.taken, max(0, budget // rows))
                if not s.rows and not pieces:
                    n = max(n, 1)  # an empty batch takes a sentence whatever it costs
                k = 0  # of those, the sentences whose rows fit at the lane's width
                while k < n:
                    wider = s.holding([*joining, job.sizes[job.taken + k]])
                    # (a sentence alone in the server fits: submit refused any that would not)
                    if wider - s.held > room and (s.sizes or joining or self.held):
                        break
                    joining.append(job.sizes[job.taken + k])
                    k += 1
                if not k:  # passed over while it has waited less than PATIENCE
                    if self._starved(job):
                        break
                    continue
                budget -= k * rows
                pieces.append((job, job.taken, job.taken + k))
                job.taken += k
                job.flying += k
                if job.taken == len(job.sentences):
                    self.jobs.remove(job)
            for job, lo, hi in pieces:
                s.rows += (hi - lo) * job.options.rows
                s.total += hi - lo
                job.holds += sum(job.sizes[lo:hi])
                s.sizes.update({(id(job), i): job.sizes[i] for i in range(lo, hi)})
            self._resize(s)
            s.inbox.extend(pieces)
        return bool(pieces)

    def _resize(self, s: Stream) -> None:
        """`held` as the sentences of `s` now hold it, each at the size of its widest."""
        wide = s.holding()
        self.held += wide - s.held
        s.held = wide

    async def _streaming(self, s: Stream) -> None:
        """The running batch `s`, decoded in a thread until it holds nothing and is handed
        nothing."""
        loop = asyncio.get_running_loop()
        future = self.decoder.submit(self._stream, s, loop)
        self.busy.add(future)
        future.add_done_callback(self.busy.discard)
        try:
            await asyncio.wrap_future(future, loop=loop)
        except Exception as e:  # noqa: BLE001 - a fault of ours: its requests got a 500
            ui.say("nmt serve: a batch failed: " + "".join(traceback.format_exception_only(e)).strip())
        finally:
            if self.streams.get((s.options, s.lane)) is s:
                del self.streams[s.options, s.lane]
            task = asyncio.current_task()
            if task is not None:
                self.decoding.discard(task)
            self.changed.set()

    def _stream(self, s: Stream, loop: asyncio.AbstractEventLoop) -> None:
        """The running batch's thread: before each step, the pieces handed to it join and the
        sentences nobody waits for leave; after it, each sentence that ended is answered."""
        members: dict[int, tuple[Job, int]] = {}  # each live sentence's job and place in it
        key = ("stream", threading.get_ident())
        pieces: list[Piece] = []
        try:
            while True:
                with self.lock:
                    pieces = list(s.inbox)
                    s.inbox.clear()
                    if not pieces and not s.search.live:
                        s.open = False
                        return
                gone = [n for n, (job, _) in members.items() if job.done.done()]
                if gone:
                    s.search.drop(gone)
                    loop.call_soon_threadsafe(self._given_up, s, [members.pop(n) for n in gone])
                if pieces:
                    self._enter(s, pieces, members, loop)
                    pieces = []
                if not s.search.live:
                    continue
                if self.stepped:  # the step waits for its turn beside the other batches
                    self.turns.step(key)
                for n, hyps in s.search.step():
                    job, i = members.pop(n)
                    answer, error = None, None
                    try:  # one answer that cannot be made fails its job alone
                        answer = _answer(self.translator.texts([hyps]), [hyps], job.options)[0]
                    except Exception as e:  # noqa: BLE001
                        error = e
                    loop.call_soon_threadsafe(self._left, s, job, i, answer, error, s.search.age(n))
                s.oldest = s.search.oldest()
        except BaseException as e:
            with self.lock:
                s.open = False
                pieces += list(s.inbox)
                s.inbox.clear()
            held = [(job, i) for job, i in members.values()]
            held += [(job, i) for job, lo, hi in pieces for i in range(lo, hi)]
            for job, i in held:
                loop.call_soon_threadsafe(self._left, s, job, i, None, e)
            raise
        finally:
            self.turns.leave([key])

    def _enter(self, s: Stream, pieces: list[Piece], members: dict, loop) -> None:
        """The pieces' sentences join the running batch at once (a blank one, or one nobody
        waits for any more, is answered at once)."""
        joining: list[tuple[Job, int, list[int]]] = []
        for job, lo, hi in pieces:
            if job.done.done():  # its client left while it waited: not decoded
                loop.call_soon_threadsafe(self._given_up, s, [(job, i) for i in range(lo, hi)])
                continue
            ids = self.translator.encode(job.sentences[lo:hi], job.options.tag)
            blank = [Hypothesis([], 0.0)] * job.options.nbest
            for k, x in enumerate(ids):
                if x:
                    joining.append((job, lo + k, x))
                else:
                    answer = _answer(self.translator.texts([blank]), [blank], job.options)[0]
                    loop.call_soon_threadsafe(self._left, s, job, lo + k, answer, None)
        if joining:
            numbers = s.search.join([x for _, _, x in joining], [job.options for job, _, _ in joining])
            members.update({n: (job, i) for n, (job, i, _) in zip(numbers, joining)})

    def _given_up(self, s: Stream, left: list[tuple[Job, int]]) -> None:
        """Sentences nobody waits for left `s` unfinished: counted in the same call as they
        leave, so that /health never shows them given up and held, or gone and not given up."""
        for job, i in left:
            self._left(s, job, i, None, None)
        self.stopped += 1

    def _left(
        self, s: Stream, job: Job, i: int, answer, error: BaseException | None, steps: int | None = None
    ) -> None:
        """Sentence i of `job` left the running batch, answered (`answer`), failed (`error`) or
        given up (neither); the job is answered with its last."""
        s.rows -= job.options.rows
        if steps is not None:  # it ended after so many steps
            self.lasted.append(steps)
        job.flying -= 1
        job.holds -= job.sizes[i]
        s.sizes.pop((id(job), i), None)
        self._resize(s)
        self._done_with(job, i, i + 1)
        if error is not None:
            self._fail(job, error)
        elif answer is not None and not job.done.done():
            job.answers[i] = answer
            job.answered += 1
            if job.answered == len(job.sentences):
                _settle(job, answers=job.answers)
        self.changed.set()

    async def _batch(self, pieces: list[Piece], held: int, long: bool = False) -> None:
        try:
            await self._serve(pieces)
        except Exception as e:  # noqa: BLE001 - a fault of ours: those requests get a 500
            ui.say("nmt serve: a batch failed: " + "".join(traceback.format_exception_only(e)).strip())
            for job, _, _ in pieces:
                _settle(job, error=e)
        finally:
            for job, lo, hi in pieces:
                self._done_with(job, lo, hi)
                job.decoding = False
                job.flying -= hi - lo
            self.held -= held
            self.long_batches -= long
            task = asyncio.current_task()
            if task is not None:
                self.decoding.discard(task)
            self.changed.set()

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

        batch, threads = next(self.batch_ids), set()

        def gone() -> list[bool]:  # asked from the decoding threads before each step
            if self.stepped:  # the step waits for its turn
                key = (batch, threading.get_ident())
                threads.add(key)
                self.turns.step(key)
            return [job.done.done() for job in jobs]

        future = self.decoder.submit(
            self._decode, sentences, options, keys, prefixes, constraints, gone, threads
        )
        self.busy.add(future)
        future.add_done_callback(self.busy.discard)
        try:
            texts, hyps = await asyncio.wrap_future(future, loop=loop)
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
                job.answers[lo:hi] = _answer(texts[start:end], hyps[start:end], job.options)
            except Exception as e:  # noqa: BLE001 - its client gets a 500, the others their answers
                self._fail(job, e)
            else:
                job.answered += hi - lo
                if job.answered == len(job.sentences):
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
        self,
        sentences: list[str],
        options: list[DecodeOptions],
        keys: list[int],
        prefixes,
        constraints,
        gone,
        threads: set,
    ):
        try:
            hyps = self.translator.hypotheses(sentences, options, keys, prefixes, constraints, gone)
        finally:  # its threads take no more steps
            self.turns.leave(list(threads))
        return self.translator.texts(hyps), hyps


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


def _settle(job: Job, answers: list | None = None, error: BaseException | None = None) -> None:
    """Answer `job`, unless it is answered already: its client left or its deadline passed (its
    future cancelled), or an earlier piece of it failed."""
    if job.done.done():
        return
    if error is not None:
        job.done.set_exception(error)
    else:
        job.done.set_result(answers)


def _within(sizes: list[int], room: int, first: bool) -> int:
    """How many of `sizes`, from the first, fit in `room` (at least one if `first`: a batch
    always takes something)."""
    total = 0
    for n, size in enumerate(sizes):
        total += size
        if total > room:
            return max(n, 1) if first else n
    return len(sizes)


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
