"""Turns at the decoding steps of `nmt serve`: the batches being decoded by nmt's engine take
their steps in turn, so that a batch that arrives while a long one decodes starts at the long
one's next step instead of after its last. The turn goes to the search that has used the least
time stepping (as Linux's fair scheduler picks the task with the least virtual run time): a
search of cheap steps takes many while a costly one takes one, so a short request beside a
costly one waits for about one of its steps, not one per step of its own."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable


class Turns:
    """Up to `slots` searches step at once (the threads a step's work is spread over); the
    others wait. A search asks for its next step with `step(key)`, which gives its slot up (if
    it holds one) and waits until it is the waiting search that has used the least time
    stepping (first come first on a tie). A newcomer counts from the least time of those
    stepping or waiting (the most that least has been), so it neither waits for their past nor
    takes all turns for itself; and no search counts more than `lead` seconds past that least,
    so one that has stepped long (alone, before the others came) waits for `lead` seconds of
    theirs at most, and a search of cheap steps beside one of costly steps gets about `lead`
    seconds of steps to each costly one."""

    def __init__(self, slots: int = 1, clock: Callable[[], float] = time.monotonic, lead: float = 0.1):
        self.slots, self.clock, self.lead = slots, clock, lead
        self.used: dict = {}  # each search's time spent stepping
        # the least time of those stepping or waiting, never lowered: where a newcomer starts,
        # so that a stream of short searches, each starting low, cannot keep a long one waiting
        self.floor = 0.0
        self.began: dict = {}  # when each holder took its slot
        self.waiting: dict = {}  # who waits for a slot, with its place in the line
        self.order = itertools.count()
        self.changed = threading.Condition()

    def step(self, key) -> None:
        """Wait for the turn of `key` (its batch and thread) to take a step."""
        with self.changed:
            now = self.clock()
            if key in self.began:
                # a search is never more than `lead` ahead of the least: one that has stepped
                # long waits for the others' `lead` seconds at most, not for all of its past
                self.used[key] = min(self.used[key] + now - self.began.pop(key), self.floor + self.lead)
            elif key not in self.used:
                self.used[key] = self.floor
            self.waiting[key] = next(self.order)
            self.changed.notify_all()
            while len(self.began) >= self.slots or self._first() != key:
                self.changed.wait()
            del self.waiting[key]
            self.began[key] = self.clock()
            self.floor = max(self.floor, min(self.used[k] for k in (*self.began, *self.waiting)))
            self.changed.notify_all()  # the next may have a slot too

    def _first(self):
        return min(self.waiting, key=lambda k: (self.used[k], self.waiting[k]))

    def leave(self, keys) -> None:
        """`keys` step no more: their slots are free and they leave the line."""
        with self.changed:
            for key in keys:
                self.began.pop(key, None)
                self.waiting.pop(key, None)
                self.used.pop(key, None)
            self.changed.notify_all()
