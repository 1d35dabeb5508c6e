"""The turns a server's batches take at their decoding steps (serve/turns.py). Time is a
clock the steps advance, so the order is the scheduler's alone."""

import threading
import time

from nmt_cli.serve.turns import Turns


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps(turns: Turns, searches: dict[str, tuple[int, float]], clock: Clock, after=None) -> list[str]:
    """Each named search takes its number of steps, each costing its time on `clock` (and a
    moment of real time, for the others' threads to ask meanwhile), in a thread of its own;
    `after` (name: (other, steps)) starts a search once another has taken that many steps. The
    order the steps ran in."""
    order: list[str] = []
    taken = {name: threading.Event() for name in searches}
    after = after or {}

    def search(name: str) -> None:
        steps, cost = searches[name]
        if name in after:
            other, n = after[name]
            taken[other].wait(10)
        key = (name, threading.get_ident())
        for _ in range(steps):
            turns.step(key)
            order.append(name)
            clock.now += cost
            time.sleep(0.002)
            if order.count(name) == max((n for o, n in after.values() if o == name), default=0):
                taken[name].set()
        turns.leave([key])

    threads = [threading.Thread(target=search, args=(n,)) for n in searches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a search never got its turn"
    return order


def test_searches_of_equal_steps_take_them_in_turn():
    """Steps of equal cost go round: once all have asked, no search takes two in a row."""
    clock = Clock()
    order = _steps(Turns(1, clock), {"a": (8, 1.0), "b": (8, 1.0), "c": (8, 1.0)}, clock)
    assert sorted(order) == sorted("abc" * 8)
    start = max(order.index(n) for n in "abc")  # the step at which the last one first asked
    end = min(len(order) - order[::-1].index(n) for n in "abc")  # ... until the first is done
    settled = order[start:end]
    assert len(settled) >= 9, order
    assert all(len(set(settled[i : i + 3])) == 3 for i in range(len(settled) - 2)), order


def test_a_search_of_cheap_steps_is_not_held_up_by_one_of_costly_steps():
    """A search whose steps cost a tenth of another's takes about ten while the other takes
    one (a lead of one costly step): the short request beside a costly one waits for about
    one costly step in all."""
    clock = Clock()
    searches = {"costly": (30, 10.0), "cheap": (8, 1.0)}
    order = _steps(Turns(1, clock, lead=10.0), searches, clock, after={"cheap": ("costly", 3)})
    first, last = order.index("cheap"), len(order) - order[::-1].index("cheap")
    assert order[first:last].count("costly") <= 1, order


def test_a_search_alone_steps_at_once_and_slots_let_several_step_at_once():
    clock = Clock()
    assert _steps(Turns(1, clock), {"a": (50, 1.0)}, clock) == ["a"] * 50
    together = threading.Barrier(2)  # both searches inside a step at once, or it breaks
    turns = Turns(2, clock)
    order: list[str] = []

    def search(name: str) -> None:
        key = (name, threading.get_ident())
        for _ in range(4):
            turns.step(key)
            together.wait(5)
            order.append(name)
        turns.leave([key])

    threads = [threading.Thread(target=search, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(order) == list("aaaabbbb")


def test_a_search_that_leaves_frees_its_slot_for_the_others():
    clock = Clock()
    turns = Turns(1, clock)
    gone = ("gone", 0)
    turns.step(gone)  # holds the only slot, then leaves without another step
    turns.leave([gone])
    assert _steps(turns, {"a": (3, 1.0), "b": (3, 1.0)}, clock)


def test_a_search_that_has_stepped_long_waits_for_the_lead_at_most():
    """A search holding a slot without stepping (a thread whose search ended while its batch's
    other one goes on) keeps the least time at 0 while another steps 20 units in the other
    slot: a search that comes then is not served until it has caught up 20 units, the long
    one counts at most `lead` (2 units) past the least and steps again after about 2 units of
    the newcomer's (4 of its steps)."""
    clock = Clock()
    turns = Turns(2, clock, lead=2.0)
    idle = ("idle", 0)
    turns.step(idle)
    searches = {"long": (30, 1.0), "late": (30, 0.5)}
    order = _steps(turns, searches, clock, after={"late": ("long", 20)})
    turns.leave([idle])
    first = order.index("late")
    assert "long" in order[first : first + 8], order
