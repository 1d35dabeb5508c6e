"""The turns a server's batches take at their decoding steps (serve/turns.py)."""

import threading
import time

from nmt_cli.serve.turns import Turns


def _steps(turns: Turns, names: list[str], steps: int, body=None) -> list[str]:
    """Each named search takes `steps` steps in a thread of its own; the order they ran in."""
    order: list[str] = []
    lined_up = threading.Barrier(len(names))

    def search(name: str) -> None:
        key = (name, threading.get_ident())
        lined_up.wait(10)
        for _ in range(steps):
            turns.step(key)
            order.append(name)
            if body is not None:
                body()
        turns.leave([key])

    threads = [threading.Thread(target=search, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a search never got its turn"
    return order


def test_searches_take_their_steps_in_turn():
    """With one slot, once every search has asked, each step goes round: no search takes two
    steps while another waits."""
    order = _steps(Turns(1), ["a", "b", "c"], 8, lambda: time.sleep(0.002))
    assert sorted(order) == sorted("abc" * 8)
    # from the step at which the last search first asked, until the first one is done
    start = max(order.index(n) for n in "abc")
    end = min(len(order) - order[::-1].index(n) for n in "abc")
    settled = order[start:end]
    assert len(settled) >= 9, order
    assert all(len(set(settled[i : i + 3])) == 3 for i in range(len(settled) - 2)), order


def test_a_search_alone_steps_without_waiting_and_slots_let_several_step_at_once():
    assert _steps(Turns(1), ["a"], 50) == ["a"] * 50
    together = threading.Barrier(2)  # both searches inside a step at once, or it breaks

    def meet() -> None:
        together.wait(5)

    assert sorted(_steps(Turns(2), ["a", "b"], 4, meet)) == list("aaaabbbb")


def test_a_search_that_leaves_frees_its_slot_for_the_others():
    turns = Turns(1)
    gone = ("gone", 0)
    turns.step(gone)  # holds the only slot, then leaves without another step
    turns.leave([gone])
    assert _steps(turns, ["a", "b"], 3)
