"""The decoding queue of `nmt serve`: requests gathered into batches, large ones in pieces; each
request's answers in order. nmt's engine on a CPU schedules step by step: a request joins a
running batch of its options at its next step and each sentence leaves it as it ends
(Served.running, one per CPU thread); running batches and the batches of the requests that
cannot join one take their steps in turn (turns.py). Elsewhere batches are decoded whole, the
requests served least first, one at a time or, with --concurrent-batches, several taking turns
step by step. CTranslate2 cannot share its steps: its batches are cut to a bounded cost, and its
workers decode several side by side; on a CPU, a batch of long sentences goes to a spare worker
(a batch cannot be stopped midway: one that decodes for minutes would hold a worker the others
need). Work is admitted while the memory its searches hold (Served.costs) fits
--max-memory."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor

from nmt_cli import ui
from nmt_cli.config import DecodeOptions, ServeConfig
from nmt_cli.errors import Stopped
from nmt_cli.serve.contract import Decoder
from nmt_cli.serve.lanes import Lanes
from nmt_cli.serve.queue import (
    Job,
    Load,
    Piece,
    answer_of,
    fits,
    memory_budget,
    ready,
    settle,
    within,
)
from nmt_cli.serve.turns import Turns

__all__ = ["Batcher", "memory_budget"]


class Batcher(Lanes):
    """Gathers the sentences of concurrent requests into decoding batches, the requests served
    least first, large ones in pieces: the queue (queue.py), the running batches (lanes.py) and
    the loop that begins batches and decodes them (here)."""

    def __init__(self, translator: Decoder, config: ServeConfig):
        super().__init__(translator, config)
        # nmt's engine asks `gone` before each step, where a batch waits for its turn
        # CTranslate2's workers (one per CPU thread) decode its batches side by side, each whole
        apart = translator.engine == "ctranslate2"
        capacity = translator.capacity()
        # ... and a spare worker (CPU) that only batches of long sentences take, up to half of
        # what decodes at once: long batches share the cores with the others, never hold them up
        self.spare = capacity.spare
        self.long_batches = 0  # long batches being decoded
        # nmt's engine on a CPU: requests whose search can take sentences midway join a running
        # batch of their options at its next step (Served.running), one per CPU thread (its
        # lanes: a step's matrices are too small for threads to share one well); the running
        # batches and the batches of the others step in turn, a thread each
        self.joins = config.running_batch and config.batching and capacity.running
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
            self.at_once = (
                (config.concurrent_batches or capacity.workers) if translator.steps_in_turn() or apart else 1
            )
            self.stepped = self.at_once > 1 and not apart
            # with several searches at once, each on one thread (not slots x all of them)
            slots, threads = (translator.slots(), 1) if self.stepped else (1, 0)
        self.cut = translator.engine != "nmt"  # batches that cannot share their steps
        self.turns = Turns(slots)
        if self.stepped:
            translator.search_in_callers(threads)
        self.batch_ids = itertools.count()
        self.decoding: set[asyncio.Task] = set()  # the batches being decoded
        self.busy: set[Future] = set()  # ... in their threads, which may outlive their tasks
        threads_needed = max(self.at_once, self.most) + self.spare
        self.decoder = ThreadPoolExecutor(threads_needed, thread_name_prefix="nmt-decode")
        # batches given up midway, and steps at which sentences left the running batch
        # unfinished: nobody waited for them any more
        self.stopped = 0

    def _fits(self, first: Job) -> bool:
        load = Load(len(self.decoding), self._busy(), self.long_batches, self.held)
        return fits(first, load, self.at_once, self.most, self.spare, self.memory)

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
            n = within(job.sizes[job.taken : job.taken + n], room, first=not pieces)
            if work is not None:
                n = min(n, within(job.costs[job.taken : job.taken + n], work, first=not pieces))
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
        return ready(first, self.jobs, self.config, time.monotonic())

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

    async def _batch(self, pieces: list[Piece], held: int, long: bool = False) -> None:
        try:
            await self._serve(pieces)
        except Exception as e:  # noqa: BLE001 - a fault of ours: those requests get a 500
            ui.say("nmt serve: a batch failed: " + "".join(traceback.format_exception_only(e)).strip())
            for job, _, _ in pieces:
                settle(job, error=e)
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
                job.answers[lo:hi] = answer_of(texts[start:end], hyps[start:end], job.options)
            except Exception as e:  # noqa: BLE001 - its client gets a 500, the others their answers
                self._fail(job, e)
            else:
                job.answered += hi - lo
                if job.answered == len(job.sentences):
                    settle(job, answers=job.answers)
            start = end

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


def _joined(parts: list[tuple[list | None, int, int]], none) -> list | None:
    """The pieces' per-sentence lists (a job's prefixes, constraints) as one list for the batch,
    `none` for the sentences of jobs without one; None if no job has one."""
    if not any(given for given, _, _ in parts):
        return None
    return [x for given, lo, hi in parts for x in (given or [none] * hi)[lo:hi]]
