"""The nmt backend of `nmt translate`: nmt's own engine with the model(s) loaded for a device and
number format, batches of source ids searched by engine/beam.py (translate.Backend)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from nmt_cli.config import DecodeOptions, TranslateConfig, resolve_precision
from nmt_cli.engine import decoding, forced
from nmt_cli.engine.batches import pad_sources
from nmt_cli.engine.device import matmuls, on, resolve_device
from nmt_cli.engine.hypothesis import Hypothesis, Source
from nmt_cli.engine.model import Transformer, undrawn
from nmt_cli.engine.packing import pack_for_cpu
from nmt_cli.errors import NmtError
from nmt_cli.inference import shortlist
from nmt_cli.inference.models import Model


def load_model(model: Model, device: torch.device, precision: str) -> Transformer:
    net = undrawn(model.config)
    try:
        net.load_state_dict(model.weights())
    except RuntimeError as e:
        raise NmtError(f"{model.where} does not fit its own model config: {str(e).splitlines()[0]}") from None
    net.eval()
    if precision == "bf16":
        net = net.to(torch.bfloat16)
    elif precision == "fp16":
        net = net.to(torch.float16)
    elif device.type == "cpu":
        net = pack_for_cpu(net)
    return net.to(device)


class Backend:
    """`model`'s parts (one model, or an ensemble's members) on the configured device."""

    def __init__(self, model: Model, config: TranslateConfig):
        # torch's thread count is the process's: it is set for the searches only, then put back
        # (a Python program that translates goes on with its own)
        self.threads = config.threads or torch.get_num_threads()
        self.device = resolve_device(config.device)
        if config.shortlist and self.device.type == "cuda":
            # its steps score a batch's own ids, which no CUDA graph holds: eager steps there,
            # which no GPU has measured against the graphed steps over the whole vocabulary
            raise NmtError(
                "--shortlist is for decoding on a CPU (on a GPU it would turn the CUDA graphs off, "
                "unmeasured): drop it, or give --device cpu"
            )
        self.precision = resolve_precision(config.precision, self.device.type, decoding=True)
        self.models = [load_model(m, self.device, self.precision) for m in model.parts]
        self.graphs = None if config.cuda_graphs else False  # None: decoding's default
        self.shortlist = shortlist.of(model) if config.shortlist else None
        if self.shortlist is not None:  # its steps project onto a batch's own ids: not graphed
            self.graphs = False
        self.slots = self.threads if self.device.type == "cpu" else 1  # batches searched at once
        # a server whose searches take their steps in turn: each in its caller's thread, on so
        # many of torch's threads (0: a call's batches spread over the threads as below)
        self.caller_threads = 0

    def search(
        self,
        batches: list[list[Source]],
        options: DecodeOptions,
        gone: list[Callable[[], list[bool]]] | None = None,
    ) -> Iterator[list[list[Hypothesis]]]:
        """The `options.nbest` best of each sentence of each batch (each ranked by its own
        alpha), batch by batch; each batch's `gone` is asked between decoding steps."""

        def one(batch: list[Source], gone: Callable[[], list[bool]] | None) -> list[list[Hypothesis]]:
            src = self._sources([s.ids for s in batch])
            bound = any(s.prefix for s in batch), any(s.constraints for s in batch)
            among = None
            if self.shortlist is not None:
                needed = [t for s in batch for t in s.prefix] + [
                    t for s in batch for c in s.constraints for t in c
                ]
                among = torch.from_numpy(self.shortlist.among([s.ids for s in batch], needed)).to(self.device)
            return decoding.translate(
                self.models,
                src,
                options,
                streams=[s.stream for s in batch],
                prefixes=[s.prefix for s in batch] if bound[0] else None,
                constraints=[s.constraints for s in batch] if bound[1] else None,
                gone=gone,
                alphas=[s.alpha for s in batch],
                graphs=self.graphs,
                among=among,
            )

        return self._each(one, batches, gone or [None] * len(batches))

    def joins(self, options: DecodeOptions) -> bool:
        """Whether a running batch (decoding.Running) takes sentences with `options` here."""
        alone = len(self.models) == 1 and self.shortlist is None
        return alone and self.device.type == "cpu" and decoding.Running.takes(options)

    def running(self, options: DecodeOptions) -> decoding.Running:
        """A running batch on the model, its steps on this process's threads (`nmt serve`'s)."""
        torch.set_num_threads(self.caller_threads or self.threads)
        return decoding.Running(self.models[0], options, self.device)

    def score(self, batches: list[list[list[int]]], targets: list[list[list[int]]]) -> Iterator[list[float]]:
        """The log-probability of each target (ids without EOS, its EOS counted) given its
        source, batch by batch."""

        def one(batch: list[list[int]], batch_targets: list[list[int]]) -> list[float]:
            src = self._sources(batch)
            return forced.log_probs(self.models, src, batch_targets)

        return self._each(one, batches, targets)

    def align(
        self, batches: list[list[list[int]]], targets: list[list[list[int]]]
    ) -> Iterator[list[list[tuple[int, int]]]]:
        """Each target's (source position, target position) pairs (forced.aligned), batch by batch."""

        def one(batch: list[list[int]], batch_targets: list[list[int]]) -> list[list[tuple[int, int]]]:
            src = self._sources(batch)
            return forced.aligned(self.models, src, batch_targets)

        return self._each(one, batches, targets)

    def _sources(self, batch: list[list[int]]) -> torch.Tensor:
        """Source ids (without EOS) as a padded batch with EOS, on the device."""
        return torch.from_numpy(pad_sources(batch)).to(self.device)

    def _each(self, work: Callable, *batches: list) -> Iterator:
        """`work` on each batch, answers in order. On a CPU, up to `threads` batches at once, one
        thread each: a decoding step's matrices are too small for threads to share one well
        (benchmarks/deploy.py). The models are only read; each search has its own cache. On a
        GPU each batch runs with the models' GPU as the current one, whichever thread (a
        server's decoding thread) or process (a --gpus worker) calls."""

        def one(*args):
            with on(self.device), matmuls(self.precision):
                return work(*args)

        # caller_threads (a server whose searches step in turn): every batch in the calling
        # thread, which then holds its turn only while it searches (a worker thread done with
        # its batches would hold one while another of the same call searches on)
        many = self.device.type == "cpu" and not self.caller_threads
        workers = min(self.threads, len(batches[0])) if many else 1
        before = torch.get_num_threads()
        torch.set_num_threads(1 if workers > 1 else self.caller_threads or self.threads)
        try:
            if workers < 2:
                yield from map(one, *batches)
                return
            with ThreadPoolExecutor(workers, thread_name_prefix="nmt-decode") as pool:
                futures = [pool.submit(one, *batch) for batch in zip(*batches)]
                try:
                    for future in futures:
                        yield future.result()
                finally:  # on an error or an interrupt, only the batches in hand finish
                    for future in futures:
                        future.cancel()
        finally:
            torch.set_num_threads(before)
