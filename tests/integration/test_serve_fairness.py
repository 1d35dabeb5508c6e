"""`nmt serve` under clients that would hold it: options whose running batches never empty, long
sentences ahead of short ones, requests that do not fit the memory left. Every waiting request
begins within a bound (batcher.py: `_make_room`, `_order`, PATIENCE)."""

import asyncio
import dataclasses
import itertools

import pytest
from conftest import DEADLINE
from test_serve_queue import Costly, StandIn, Stepping, _in_process

from nmt_cli.serve.contract import Served


def test_options_whose_running_batches_never_empty_lock_no_request_out(trained):
    """Four option keys (four min_len values), two clients each, half a request apart, loop
    one-word requests: their running batches would hold every slot of a two-lane server for as
    long as they send (each ends only when empty, and one of its clients always has a sentence
    in it). A request of the default options arrives: it is answered while they
    still send, exactly as `nmt translate` answers it."""
    translator = Served.load(trained, engine="nmt", threads=2)  # two lanes: four running batches
    rounds = 40  # each attacking client's requests at most: the test ends either way
    answered = itertools.count()
    line = "a dog runs on the grass ."

    async def scenario(post, get):
        stop = asyncio.Event()

        async def attack(k: int, late: bool):
            if late:
                await asyncio.sleep(0.03)
            for _ in range(rounds):
                if stop.is_set():
                    return
                body = {"text": ["a"], "beam": 1, "min_len": 60 - k, "max_len_b": 60, "max_len_a": 0.0}
                assert (await post(body))[0] == 200
                next(answered)

        clients = [asyncio.ensure_future(attack(k, late)) for k in range(4) for late in (False, True)]
        while (await get("/health"))[1]["decoding"] < 4:  # every slot held
            await asyncio.sleep(0.001)
        before = next(answered)
        honest = asyncio.ensure_future(post([line]))
        while not honest.done():
            await asyncio.sleep(0.005)
        during = next(answered) - before - 1  # attacking requests answered meanwhile
        stop.set()
        await asyncio.gather(*clients)
        return await honest, during

    honest, during = _in_process(translator, scenario, max_wait_ms=0)
    assert honest == (200, {"translations": translator.translate([line])})
    print("attacking requests answered while the request waited:", during)
    assert during < rounds, f"answered only after {during} attacking requests"


def test_a_row_of_a_running_batch_is_counted_at_its_lanes_width(trained):
    """A short sentence that joins a lane beside a long one holds as much as the long one (the
    caches are padded to the longest source and output): /health's held bytes say so."""
    translator = Served.load(trained, engine="nmt", threads=1)  # one lane
    long_line = " ".join(["a dog runs on the grass ."] * 20)
    options = {"min_len": 600, "max_len_b": 600, "max_len_a": 0.0}
    decode = dataclasses.replace(translator.config.decode, **options)
    _, (long_size, short_size) = translator.costs([long_line, "a cat ."], decode)
    assert short_size < long_size

    async def scenario(post, get):
        first = asyncio.ensure_future(post({"text": [long_line], **options}))
        while (health := (await get("/health"))[1])["held_bytes"] == 0:
            await asyncio.sleep(0.001)
        alone = health["held_bytes"]
        short = asyncio.ensure_future(post({"text": ["a cat ."], **options}))
        while (health := (await get("/health"))[1])["held_bytes"] == alone and not first.done():
            await asyncio.sleep(0.001)
        together = health["held_bytes"], first.done()
        return alone, together, await first, await short

    alone, (together, ended), first, short = _in_process(translator, scenario, max_wait_ms=0)
    assert first[0] == short[0] == 200 and not ended
    assert (alone, together) == (long_size, 2 * long_size)


class Sized(StandIn):
    """A stand-in whose sentences hold a MiB per character."""

    engine = "nmt"

    def costs(self, sentences, options, prefixes=None, constraints=None):
        return self.work(sentences, options), [len(s) << 20 for s in sentences]


@pytest.mark.parametrize("patience", [60.0, 0.0])
def test_batch_admission_passes_over_what_does_not_fit_for_a_while_then_waits_for_it(patience, monkeypatch):
    """Batch by batch (--no-running-batch): a request that does not fit the memory left is
    passed over by a later one that does, for PATIENCE seconds; past them the later ones wait
    for it (it is decoded first, the small one beside it), and /health says how long it waited."""
    from nmt_cli.serve import queue

    monkeypatch.setattr(queue, "PATIENCE", patience)
    decoder = Sized()

    async def scenario(post, get):
        held = asyncio.ensure_future(post(["slow"]))  # 4 MiB of 8, held
        while not decoder.batches:
            await asyncio.sleep(0.001)
        big = asyncio.ensure_future(post(["y" * 6]))  # 6 MiB: does not fit beside it
        while (await get("/health"))[1]["queued"] < 2:
            await asyncio.sleep(0.001)
        small = asyncio.ensure_future(post(["z"]))  # 1 MiB: fits
        if patience:
            await small  # answered while the big one waits
        else:
            await asyncio.sleep(0.2)  # not begun: it waits behind the big one
        waited = (await get("/health"))[1]["oldest_wait_s"]
        decoder.release.set()
        return await small, await big, await held, waited

    small, big, held, waited = _in_process(
        decoder, scenario, max_wait_ms=0, max_memory=8, running_batch=False, concurrent_batches=2
    )
    assert small == (200, {"translations": ["Z"]}) and big == (200, {"translations": ["Y" * 6]})
    assert held[0] == 200 and waited >= (0 if patience else 0.2)
    if patience:
        assert decoder.batches == [["slow"], ["z"], ["y" * 6]]
    else:
        assert decoder.batches == [["slow"], ["y" * 6, "z"]]


@pytest.mark.parametrize("spare", [1, 0])
def test_a_batch_that_may_run_hundreds_of_steps_takes_the_spare_worker_at_any_beam(spare):
    """CTranslate2 cannot stop a batch: one sentence at beam 1 whose output may run 1,000 steps
    (a min_len of 1,000: little work, many steps) goes to the spare worker, and a request behind
    it is answered beside it; without the spare it waits for it."""
    decoder = Costly(spare, stubborn=1000)

    async def scenario(post, get):
        held = asyncio.ensure_future(post({"text": ["stubborn"], "beam": 1}))
        while not decoder.batches:
            await asyncio.sleep(0.01)
        quick = asyncio.ensure_future(post(["quick"]))
        done, _ = await asyncio.wait([quick], timeout=DEADLINE / 4 if spare else 0.5)
        decoder.release.set()
        return bool(done), await held, await quick

    beside, held, quick = _in_process(decoder, scenario, max_wait_ms=0)
    assert beside == bool(spare) and held[0] == quick[0] == 200


def test_a_sentence_that_does_not_fit_waits_without_beginning_lanes_for_nothing(trained, monkeypatch):
    """Two lanes, --max-memory room for one long sentence: a second one waits for room (one
    error of the past: an empty lane took a sentence whatever the memory held), and while it
    waits no running batch is begun that would take nothing and end at once, again and again."""
    translator = Served.load(trained, engine="nmt", threads=2)
    long_line = " ".join(["a dog runs on the grass ."] * 20)
    options = {"beam": 16, "min_len": 900, "max_len_b": 1000, "max_len_a": 0.0}
    _, (size,) = translator.costs([long_line], dataclasses.replace(translator.config.decode, **options))
    assert size > 1 << 20, size
    mib = -(-3 * size // 2 >> 20)  # one fits, two do not
    begun: list = []
    running = Served.running
    monkeypatch.setattr(Served, "running", lambda self, o: begun.append(o) or running(self, o))

    async def scenario(post, get):
        first = asyncio.ensure_future(post({"text": [long_line], **options}))
        while (await get("/health"))[1]["held_bytes"] == 0:
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(post({"text": [long_line], **options}))
        while (await get("/health"))[1]["queued"] < 2:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.3)
        health = (await get("/health"))[1]
        first.cancel()
        second.cancel()
        return health

    health = _in_process(translator, scenario, max_wait_ms=0, max_memory=mib)
    assert health["held_bytes"] == size and health["decoding"] == 1 and len(begun) == 1, (health, begun)


@pytest.mark.parametrize("spare", [1, 0])
def test_a_long_batch_that_cannot_stop_takes_the_spare_worker_and_holds_no_request_up(spare):
    """CTranslate2 cannot stop a batch midway: a sentence of 16 typical sentences' work or more
    (beam 16 to its longest output, say) goes to the spare worker a CPU server keeps, one such
    batch at a time, while the other requests keep the workers they had. Without the spare,
    the one worker holds the request that arrives behind it."""
    import asyncio

    decoder = Costly(spare, stubborn=5000)

    async def scenario(post, get):
        held = asyncio.ensure_future(post(["stubborn"]))
        while not decoder.batches:
            await asyncio.sleep(0.01)
        quick = asyncio.ensure_future(post(["quick"]))
        done, _ = await asyncio.wait([quick], timeout=DEADLINE / 4 if spare else 0.5)
        again = asyncio.ensure_future(post(["stubborn"]))  # waits for the first: one at a time
        await asyncio.sleep(0.2)
        begun = list(decoder.batches)
        decoder.release.set()
        return bool(done), begun, await held, await quick, await again

    beside, begun, *answers = _in_process(decoder, scenario, max_wait_ms=0)
    assert beside == bool(spare) and all(status == 200 for status, _ in answers)
    assert begun == ([["stubborn"], ["quick"]] if spare else [["stubborn"]])


@pytest.mark.parametrize("room", [1, 2])
def test_batches_begin_while_the_memory_of_those_decoding_leaves_room(room):
    """Each sentence's search holds its bytes (here 1 MiB): with --max-memory 1 a request waits
    for the batch that holds it, with 2 it is decoded beside it; a sentence larger than
    --max-memory alone is refused with 413, whatever is decoding."""
    import asyncio

    decoder = Stepping()
    decoder.size = 1 << 20

    async def scenario(post, get):
        held = asyncio.ensure_future(post(["slow"]))
        while not decoder.batches:
            await asyncio.sleep(0.01)
        quick = asyncio.ensure_future(post(["quick"]))
        done, _ = await asyncio.wait([quick], timeout=DEADLINE / 4 if room > 1 else 0.5)
        decoder.size = (room + 1) << 20
        refused = await post(["too large"])
        decoder.size = 1 << 20
        decoder.release.set()
        return bool(done), refused, await held, await quick

    beside, refused, held, quick = _in_process(
        decoder, scenario, max_wait_ms=0, max_memory=room, concurrent_batches=4
    )
    assert beside == (room > 1) and held[0] == quick[0] == 200
    assert decoder.finished == ([["quick"], ["slow"]] if room > 1 else [["slow"], ["quick"]])
    assert refused[0] == 413 and f"decodes in {room} MiB (--max-memory)" in refused[1]["error"]


class Wordy(StandIn):
    """A stand-in whose sentences cost their words (rows x words), as a long sentence costs
    CTranslate2 more than a short one."""

    def work(self, sentences, options, prefixes=None, constraints=None):
        return [options.rows * len(s.split()) for s in sentences]

    def work_of(self, lengths, options, forced=None, phrases=None):
        return [options.rows * n for n in lengths]


@pytest.mark.parametrize("engine", ["ctranslate2", "nmt"])
def test_a_decoder_that_cannot_share_its_steps_gets_batches_of_bounded_cost(engine):
    """CTranslate2 cannot take a request into a batch it has begun: its batches are cut to
    --max-batch typical sentences' work (here 4 x 32 words), a long sentence alone, so that a
    long request goes in pieces that take their turn with the others'. nmt's engine takes its
    steps in turn with other batches, and batches by sentences alone."""
    long, longer = " ".join(["w"] * 100), " ".join(["w"] * 300)
    decoder = Wordy()
    decoder.engine = engine

    async def scenario(post, get):
        return await post([long, long, "s1", "s2", "s3", "s4", longer])

    status, body = _in_process(decoder, scenario, max_batch=4, max_wait_ms=0)
    assert status == 200 and len(body["translations"]) == 7
    if engine == "ctranslate2":
        assert decoder.batches == [[long], [long, "s1", "s2", "s3"], ["s4"], [longer]]
    else:
        assert decoder.batches == [[long, long, "s1", "s2"], ["s3", "s4", longer]]
