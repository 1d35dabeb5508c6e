"""Turns at the decoding steps of `nmt serve`: the batches being decoded by nmt's engine take
their steps in turn, first come first served, so that a batch that arrives while a long one
decodes starts at the long one's next step instead of after its last."""

from __future__ import annotations

import threading
from collections import deque


class Turns:
    """Up to `slots` searches step at once (the threads a step's work is spread over); the
    others wait in line. A search asks for its next step with `step(key)`, which gives its
    slot up (if it holds one) and waits in line for one again: each step goes round."""

    def __init__(self, slots: int = 1):
        self.slots = slots
        self.line: deque = deque()  # who waits for a slot, first come first
        self.holding: set = set()
        self.changed = threading.Condition()

    def step(self, key) -> None:
        """Wait for the turn of `key` (its batch and thread) to take a step."""
        with self.changed:
            if key in self.holding:
                if not self.line:  # nobody waits: go on without a round trip
                    return
                self.holding.discard(key)
                self.changed.notify_all()
            self.line.append(key)
            while self.line[0] != key or len(self.holding) >= self.slots:
                self.changed.wait()
            self.line.popleft()
            self.holding.add(key)
            self.changed.notify_all()  # the next in line may have a slot too

    def leave(self, keys) -> None:
        """`keys` step no more: their slots are free and they leave the line."""
        with self.changed:
            for key in keys:
                self.holding.discard(key)
                if key in self.line:
                    self.line.remove(key)
            self.changed.notify_all()
