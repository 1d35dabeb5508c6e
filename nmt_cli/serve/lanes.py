"""The running batches of `nmt serve` (nmt's engine on a CPU): a request joins a running batch of
its options at its next step and each sentence leaves it as it ends (Served.running), one
batch per lane (a CPU thread); running batches and the batches of the requests that cannot join
one take their steps in turn (turns.py). Who may join: Served.joins, with --running-batch."""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nmt_cli import ui
from nmt_cli.config import DecodeOptions, ServeConfig
from nmt_cli.engine.hypothesis import Hypothesis
from nmt_cli.serve.contract import Decoder
from nmt_cli.serve.queue import Job, Piece, Queue, answer_of, settle
from nmt_cli.serve.turns import Turns

# sentences a running batch takes before it ends and another takes its place
RENEW = 100_000
# once a sentence has run this many times the median sentence's steps (of the last LASTED to
# end), the lane that holds the longest-running one takes no sentences while another can
LONGER, LASTED = 1.5, 256


@dataclass(eq=False)
class Stream:
    """The running batch of nmt's engine (Served.running): the options its sentences share,
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


class Lanes(Queue):
    """The running batches over the queue, by their options and lane. The loop's state they
    share (set by Batcher): the searches being decoded and their threads, the turns their steps
    take, and how many may run at once."""

    lanes: int
    at_once: int
    most: int
    stepped: bool
    turns: Turns
    decoding: set[asyncio.Task]
    busy: set[Future]
    decoder: ThreadPoolExecutor
    stopped: int

    def __init__(self, translator: Decoder, config: ServeConfig):
        super().__init__(translator, config)
        self.streams: dict[tuple[DecodeOptions, int], Stream] = {}
        self.lasted: deque[int] = deque(maxlen=LASTED)  # the steps of the sentences that ended last
        self.lock = threading.Lock()  # the stream's inbox and end, between the loop and its thread

    def _busy(self) -> int:
        """The searches that hold a slot: all but the running batches that take no sentences."""
        return len(self.decoding) - sum(not s.takes for s in self.streams.values())

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

    def _joinable(self, job: Job) -> bool:
        return self.joins and self.translator.joins(job.options, job.prefixes, job.constraints)

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
                        answer = answer_of(self.translator.texts([hyps]), [hyps], job.options)[0]
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
                    answer = answer_of(self.translator.texts([blank]), [blank], job.options)[0]
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
                settle(job, answers=job.answers)
        self.changed.set()
