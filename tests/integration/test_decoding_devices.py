"""A GPU other than GPU 0, as `translate --gpus 2`'s second worker and a server on `--device
cuda:1` decode on it, checked on the CPU: the searches run with that GPU current, whichever
process or thread runs them (tests/strict_cuda.py stands in for torch.cuda; the tensors stay on
the CPU)."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch
from strict_cuda import StrictCuda

from nmt_cli.config import ServeConfig, TranslateConfig
from nmt_cli.engine import decoding
from nmt_cli.inference import backend_nmt, workers
from nmt_cli.serve.contract import Served
from nmt_cli.textio import Request


@pytest.fixture
def on_cuda_1(monkeypatch):
    """Two recorded GPUs; the models load and the sources go to the CPU whatever the device;
    each search notes which GPU was current in its thread."""
    cuda = StrictCuda(count=2).install(monkeypatch)
    load = backend_nmt.load_model
    monkeypatch.setattr(
        backend_nmt,
        "load_model",
        lambda model, device, precision: load(model, torch.device("cpu"), precision),
    )
    monkeypatch.setattr(
        backend_nmt.Backend, "_sources", lambda self, batch: torch.from_numpy(backend_nmt.pad_sources(batch))
    )
    searched = []
    translate = decoding.translate

    def noting(*args, **kwargs):
        searched.append(cuda.current())
        return translate(*args, **kwargs)

    monkeypatch.setattr(decoding, "translate", noting)
    return searched


def test_a_gpus_worker_decodes_on_its_own_gpu(trained, on_cuda_1, monkeypatch):
    """`--gpus 2`'s second worker (given cuda:1 at its start) searches with cuda:1 current."""

    class Devices:
        def get(self):
            return "cuda:1"

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(workers, "_translator", None)
    monkeypatch.setattr(workers, "_failed", None)
    try:
        workers._start(workers.Spread(trained, [], None, gpus=2), TranslateConfig(device="cuda"), Devices())
    finally:
        signal.signal(signal.SIGINT, before)
    assert workers._failed is None, workers._failed
    out, _ = workers._translate(Request(0, ["a dog runs .", "two men ."], None, None))
    assert len(out) == 2 and on_cuda_1 and set(on_cuda_1) == {1}


def test_the_servers_decoding_thread_decodes_on_the_models_gpu(trained, on_cuda_1):
    """`nmt serve --device cuda:1`: its decoding thread (a new thread: GPU 0 current) searches
    with cuda:1 current."""
    from nmt_cli.serve.batcher import Batcher

    translator = Served.load(trained, device="cuda:1")
    assert translator.config.device == "cuda:1"

    async def serve() -> list:
        batcher = Batcher(translator, ServeConfig())
        loop = asyncio.create_task(batcher.run())
        await asyncio.sleep(0)
        try:
            answer = batcher.submit(["a dog runs ."], translator.config.decode)
            return await asyncio.wait_for(answer, 60)
        finally:
            loop.cancel()
            batcher.decoder.shutdown(wait=True)

    assert len(asyncio.run(serve())) == 1
    assert on_cuda_1 == [1]
