"""`nmt serve`'s running batches (nmt's engine on a CPU): a request joins the batch of its
options at its next step, leaves it as it ends, and a batch that took its share of sentences
makes way; each in a lane of its own while another is busy."""

import pytest
from test_serve_queue import _in_process


def _joined_while_running(monkeypatch) -> list[int]:
    """Records, at each join of a running batch, how many sentences it was decoding then."""
    from nmt_cli.engine import decoding

    seen: list[int] = []
    join = decoding.Running.join
    monkeypatch.setattr(decoding.Running, "join", lambda self, *a: seen.append(self.live) or join(self, *a))
    return seen


@pytest.mark.parametrize("running_batch", [True, False])
def test_a_request_joins_the_running_batch_at_its_next_step(trained, monkeypatch, running_batch):
    """nmt's engine on a CPU: a request that arrives while a batch of its options decodes joins
    it at its next step and is answered before it ends (each sentence leaves as it ends), the
    answers exactly `nmt translate`'s; without the running batch it waits for the batch."""
    import asyncio

    from nmt_cli.serve.contract import Served

    options = {"min_len": 200, "max_len_b": 200, "max_len_a": 0.0}
    translator = Served.load(trained, engine="nmt", threads=1, **options)  # one lane: one running batch
    joins = _joined_while_running(monkeypatch)
    lines = [f"a dog runs {'on the grass ' * i}." for i in range(6)]
    expected = translator.translate(lines)

    async def scenario(post, get):
        long = asyncio.ensure_future(post({"text": lines[:4], **options}))
        while (await get("/health"))[1]["decoding"] < 1:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # a few of its steps
        short = await post({"text": lines[4:], **options, "max_len_b": 10})
        late = long.done()
        return await long, short, late

    long, short, late = _in_process(translator, scenario, max_wait_ms=0, running_batch=running_batch)
    assert long == (200, {"translations": expected[:4]})
    capped = Served.load(trained, engine="nmt", threads=2, **{**options, "max_len_b": 10})
    assert short == (200, {"translations": capped.translate(lines[4:])})
    if running_batch:
        assert not late and joins[0] == 0 and joins[1] == 4, joins  # it joined 4 sentences decoding
    else:
        assert late and not joins


def test_the_rows_of_a_request_nobody_waits_for_leave_the_running_batch_at_its_next_step(
    trained, monkeypatch
):
    """Two requests decode in one running batch; the client of one leaves: its sentences leave
    at the next step, and the other's are decoded exactly as before."""
    import asyncio

    from nmt_cli.serve.contract import Served

    options = {"min_len": 300, "max_len_b": 300, "max_len_a": 0.0}  # longer than the test waits
    translator = Served.load(trained, engine="nmt", threads=2, **options)
    lines = [f"a cat sits {'on the mat ' * i}." for i in range(5)]
    expected = translator.translate(lines[3:])
    from nmt_cli.engine import decoding

    dropped: list = []
    drop = decoding.Running.drop
    monkeypatch.setattr(decoding.Running, "drop", lambda self, s: dropped.append(len(s)) or drop(self, s))
    joined: list[int] = []  # the sentences of each join
    join = decoding.Running.join
    monkeypatch.setattr(
        decoding.Running, "join", lambda self, x, o: joined.append(len(x)) or join(self, x, o)
    )

    async def scenario(post, get):
        leaving = asyncio.ensure_future(post({"text": lines[:3], **options}))
        staying = asyncio.ensure_future(post({"text": lines[3:], **options}))
        while sum(joined) < 5:  # all five decoding
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        leaving.cancel()
        while (await get("/health"))[1]["queued"] > 2:
            await asyncio.sleep(0.001)
        health = (await get("/health"))[1]
        return health, staying.done(), await staying

    health, finished, staying = _in_process(translator, scenario, max_wait_ms=0)
    assert dropped == [3] and health["given_up"] == 1 and not finished
    assert staying == (200, {"translations": expected})


def test_a_request_begins_a_lane_of_its_own_while_the_other_is_busy(trained, monkeypatch):
    """With two CPU threads a running batch has two lanes, each stepping on one thread: a request
    that arrives while the first lane decodes begins the second (a step's matrices are too small
    for two threads to share one well), and answers exactly as `nmt translate`."""
    import asyncio

    from nmt_cli.serve.contract import Served

    options = {"min_len": 200, "max_len_b": 200, "max_len_a": 0.0}
    translator = Served.load(trained, engine="nmt", threads=2, **options)
    joins = _joined_while_running(monkeypatch)
    lines = [f"a bird flies {'over the lake ' * i}." for i in range(6)]
    expected = translator.translate(lines)

    async def scenario(post, get):
        first = asyncio.ensure_future(post({"text": lines[:4], **options}))
        while (await get("/health"))[1]["decoding"] < 1:
            await asyncio.sleep(0.001)
        second = await post({"text": lines[4:], **options})
        health = (await get("/health"))[1]
        return await first, second, health

    first, second, health = _in_process(translator, scenario, max_wait_ms=0)
    assert first == (200, {"translations": expected[:4]}) and second == (200, {"translations": expected[4:]})
    assert joins == [0, 0], joins  # each began a running batch of its own


def test_the_lane_of_a_sentence_that_decodes_long_takes_no_more_while_another_can(trained, monkeypatch):
    """Two lanes, each decoding a sentence kept long by min_len, the first begun first: both have
    run more than 1.5 times the steps of the sentences that ended before, so the first lane
    takes no sentence while the second can. A request of their options that arrives then joins
    the second lane, although both hold as many rows, and is answered exactly as `nmt translate`
    answers it."""
    import asyncio

    from nmt_cli.engine import decoding
    from nmt_cli.serve.contract import Served

    translator = Served.load(trained, engine="nmt", threads=2)
    joined: list[tuple[int, int]] = []  # each join's running batch and the sentences it held
    steps: dict[int, int] = {}  # each running batch's steps so far
    join, step = decoding.Running.join, decoding.Running.step
    monkeypatch.setattr(
        decoding.Running, "join", lambda self, *a: joined.append((id(self), self.live)) or join(self, *a)
    )
    monkeypatch.setattr(
        decoding.Running,
        "step",
        lambda self: steps.update({id(self): steps.get(id(self), 0) + 1}) or step(self),
    )
    long = {"min_len": 300, "max_len_b": 300, "max_len_a": 0.0}
    short = ["a dog runs .", "a cat sits .", "two men talk ."]

    async def scenario(post, get):
        for line in short:  # sentences that end: what a sentence's steps are
            assert (await post([line]))[0] == 200
        most = max(steps.values())  # the steps of the longest of them
        steps.clear()
        first = asyncio.ensure_future(post({"text": ["a dog runs on the grass ."], **long}))
        while (await get("/health"))[1]["decoding"] < 1:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(post({"text": ["a cat sits on the mat ."], **long}))
        while (await get("/health"))[1]["decoding"] < 2:
            await asyncio.sleep(0.001)
        while min(steps.get(search, 0) for search, _ in joined[-2:]) <= 2 * most:  # both past 1.5x
            await asyncio.sleep(0.001)
        late = await post({"text": ["a bird sings ."], **long})
        return late, await first, await second

    late, first, second = _in_process(translator, scenario, max_wait_ms=0)
    expected = Served.load(trained, engine="nmt", threads=2, **long).translate(["a bird sings ."])
    assert late == (200, {"translations": expected})
    assert first[0] == second[0] == 200
    lanes = [search for search, _ in joined]
    assert joined[-1] == (lanes[-2], 1), joined  # the second lane's, beside its one sentence


def test_a_request_whose_running_batch_is_full_holds_up_no_other_options(trained):
    """The running batch of beam-8 requests is full (--max-batch 2: one such sentence) and a
    second waits for room: a request at other options, arriving after it, begins its own
    running batch at once instead of waiting behind it."""
    import asyncio

    from nmt_cli.serve.contract import Served

    translator = Served.load(trained, engine="nmt", threads=1)
    wide = {"beam": 8, "min_len": 300, "max_len_b": 300, "max_len_a": 0.0}

    async def scenario(post, get):
        first = asyncio.ensure_future(post({"text": ["a dog runs ."], **wide}))
        while (await get("/health"))[1]["decoding"] < 1:
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(post({"text": ["a cat sits ."], **wide}))
        while (await get("/health"))[1]["queued"] < 2:
            await asyncio.sleep(0.001)
        other = await post({"text": ["a bird sings ."]})
        waiting = first.done(), second.done()
        return other, waiting, await first, await second

    other, waiting, first, second = _in_process(translator, scenario, max_wait_ms=0, max_batch=2)
    assert other == (200, {"translations": translator.translate(["a bird sings ."])})
    assert waiting == (False, False) and first[0] == second[0] == 200


def test_a_running_batch_that_took_its_share_of_sentences_ends_and_another_takes_its_place(
    trained, monkeypatch
):
    """A running batch keeps a little of every sentence it took: past RENEW sentences it takes
    no more, and the next request waits for it to end and begins a new one (here RENEW 1)."""
    import asyncio

    from nmt_cli.serve import lanes
    from nmt_cli.serve.contract import Served

    monkeypatch.setattr(lanes, "RENEW", 1)
    options = {"min_len": 100, "max_len_b": 100, "max_len_a": 0.0}
    translator = Served.load(trained, engine="nmt", threads=1, **options)
    joins = _joined_while_running(monkeypatch)

    async def scenario(post, get):
        first = asyncio.ensure_future(post({"text": ["a dog runs ."], **options}))
        while (await get("/health"))[1]["decoding"] < 1:
            await asyncio.sleep(0.001)
        second = await post({"text": ["a cat sits ."], **options})
        return first.done(), await first, second

    ended_first, first, second = _in_process(translator, scenario, max_wait_ms=0)
    assert ended_first and first[0] == second[0] == 200 and joins == [0, 0], joins
