"""The server's ordering and admission decisions (serve/queue.py), as pure functions of hand-made
queues: who is served first, whether a batch may begin, and when."""

from concurrent.futures import Future

from nmt_cli.config import DecodeOptions, ServeConfig
from nmt_cli.serve.queue import Job, Load, fits, order, ready, within


def job(n: int = 1, arrived: float = 0.0, taken: int = 0, holds: int = 0, long: bool = False, size: int = 10):
    j = Job(["x"] * n, DecodeOptions(), None, None, Future(), [1] * n, [size] * n, arrived=arrived)  # type: ignore[arg-type]
    j.taken, j.holds, j.long = taken, holds, long
    return j


def test_batch_by_batch_the_request_served_least_goes_first_then_the_oldest():
    large = job(500, arrived=0.0, taken=64)  # a piece of it decoded already
    newcomer = job(1, arrived=5.0)
    older = job(1, arrived=1.0)
    assert sorted([large, newcomer, older], key=lambda j: order(j, running=False)) == [older, newcomer, large]


def test_with_running_batches_the_request_holding_least_goes_first():
    holding = job(10, arrived=0.0, taken=3, holds=3_000)  # its sentences hold much in the lanes
    served_more = job(10, arrived=2.0, taken=8, holds=100)
    fresh = job(1, arrived=9.0)
    assert sorted([holding, served_more, fresh], key=lambda j: order(j, running=True)) == [
        fresh,
        served_more,
        holding,
    ]
    # batch by batch the same three go by what was taken
    assert sorted([holding, served_more, fresh], key=lambda j: order(j, running=False)) == [
        fresh,
        holding,
        served_more,
    ]


def test_a_batch_begins_only_where_a_slot_of_its_kind_and_the_memory_are_free():
    short, long = job(), job(long=True)
    idle = Load(searches=0, busy=0, long_batches=0, held=0)
    assert fits(short, idle, at_once=2, most=0, spare=1, memory=100)
    full = Load(searches=2, busy=2, long_batches=0, held=0)
    assert not fits(short, full, at_once=2, most=0, spare=1, memory=100)
    assert fits(long, full, at_once=2, most=0, spare=1, memory=100)  # the spare takes it
    one_long = Load(searches=3, busy=3, long_batches=1, held=0)
    assert not fits(long, one_long, at_once=2, most=0, spare=2, memory=100)  # half of at_once: 1
    assert fits(long, Load(2, 2, 1, 0), at_once=4, most=0, spare=1, memory=100)  # half of 4: 2
    # the short ones still have their slots beside a long batch
    assert fits(short, Load(2, 2, 1, 0), at_once=2, most=0, spare=1, memory=100)
    # memory: the next sentence's bytes beside what is held
    assert fits(job(size=40), Load(1, 1, 0, 60), at_once=2, most=0, spare=0, memory=100)
    assert not fits(job(size=41), Load(1, 1, 0, 60), at_once=2, most=0, spare=0, memory=100)
    # never more searches than `most` (running batches draining beside new ones) and the spare
    assert fits(
        short, Load(searches=3, busy=1, long_batches=0, held=0), at_once=2, most=4, spare=0, memory=100
    )
    assert not fits(
        short, Load(searches=4, busy=1, long_batches=0, held=0), at_once=2, most=4, spare=0, memory=100
    )


def test_a_batch_waits_to_fill_for_max_wait_ms_at_most():
    config = ServeConfig(max_batch=4, max_wait_ms=5.0)
    first = job(1, arrived=10.0)
    assert not ready(first, [first], config, now=10.004)
    assert ready(first, [first], config, now=10.005)
    assert ready(first, [first, job(3, arrived=10.001)], config, now=10.001)  # a full batch's worth
    assert not ready(first, [first, job(3, arrived=10.001, taken=1)], config, now=10.001)
    assert ready(first, [first], ServeConfig(batching=False), now=10.0)


def test_a_piece_takes_what_fits_and_a_batch_at_least_one():
    assert within([30, 30, 30], room=70, first=False) == 2
    assert within([80, 10], room=70, first=False) == 0
    assert within([80, 10], room=70, first=True) == 1
    assert within([10, 10], room=70, first=False) == 2
