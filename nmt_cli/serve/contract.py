"""What the server needs of a translator, typed: `Decoder`; and `Served`, nmt's Translator
answering it (mypy checks so where serve/app.py hands one to the batcher). The tests' stand-ins
imitate it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.engine.hypothesis import Hypothesis, limits
from nmt_cli.inference.backend import Capacity
from nmt_cli.inference.translator import Translator


class Decoder(Protocol):
    engine: str  # "nmt" steps a batch and can give it up between steps; others decode it whole
    config: TranslateConfig

    def costs(
        self,
        lines: list[str],
        options: DecodeOptions,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
    ) -> tuple[list[int], list[int]]: ...

    def work_of(self, lengths: list[int], options: DecodeOptions) -> list[int]: ...

    def capacity(self) -> Capacity: ...

    def steps_in_turn(self) -> bool: ...

    def slots(self) -> int: ...

    def search_in_callers(self, threads: int) -> None:
        """Each search in its caller's thread, on `threads` CPU threads (0: all of them)."""

    def joins(
        self, options: DecodeOptions, prefixes: list[str] | None = None, constraints: list | None = None
    ) -> bool: ...

    def running(self, options: DecodeOptions) -> Any: ...

    def encode(self, lines: list[str], tag: str = "", first: list[int] | None = None) -> list[list[int]]: ...

    def hypotheses(
        self,
        lines: list[str],
        options: DecodeOptions | list[DecodeOptions],
        keys: list[int] | None = None,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        gone: Callable[[], list[bool]] | None = None,
    ) -> list[list[Hypothesis]]: ...

    def texts(self, hyps: list[list[Hypothesis]]) -> list[list[str]]: ...

    def many_targets(self) -> tuple[str, ...]: ...


class Served(Translator):
    """A Translator as `nmt serve` asks of it: what each request costs, how batches may decode
    side by side, and running batches that sentences join between steps."""

    def costs(
        self,
        lines: list[str],
        options: DecodeOptions,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """What decoding each line may cost: its work in tokens, its hypotheses at once
        (DecodeOptions.rows) times its output limit (hypothesis.limits: what its length, prefix,
        constraints and max_len allow); and the bytes its search holds at most (the decoder's
        caches for those rows and limit, the encoder's keys and values, a step's scores over
        the vocabulary, the alignments' attention); an empty line nothing. `nmt serve`'s queue
        and its memory are bounded by them, so they are read on the server's event loop: the
        pieces of the raw text, not cleaned (cleaning would cost most of the time and changes a
        count by a piece or two)."""
        first, start = self.language_tokens(options)
        tagged = (1 if options.tag else 0) + len(first)
        lengths = [min(len(x) + tagged, self.max_src) if x else 0 for x in self.source_sp.encode(lines)]
        forced = self.target_sp.encode(prefixes) if prefixes is not None else None
        if start:
            forced = [start + f for f in forced] if forced is not None else [start] * len(lines)
        phrases = [self.target_sp.encode(c) for c in constraints] if constraints else None
        work = self.work_of(lengths, options, forced, phrases)
        sizes = []
        for length, tokens in zip(lengths, work):
            if not length:
                sizes.append(0)
                continue
            limit = tokens // options.rows + 1
            size = sum(
                per_token * (4 * options.rows * limit + 2 * (length + 1)) + 12 * options.rows * vocab
                for per_token, vocab in self.parts
            )
            if options.alignments:
                size += 4 * options.nbest * limit * (length + 1) * len(self.parts)
            sizes.append(size)
        return work, sizes

    def steps_in_turn(self) -> bool:
        """Whether a server may decode several batches at once, taking their steps in turn:
        nmt's engine on a CPU. On a GPU one batch at a time until a GPU has measured it (a graph
        captured in one thread while another launches kernels would fail its capture)."""
        return self._nmt_on_cpu()

    def joins(
        self, options: DecodeOptions, prefixes: list[str] | None = None, constraints: list | None = None
    ) -> bool:
        """Whether sentences with `options`, `prefixes` and `constraints` may join a running batch
        (`running`): nmt's engine on a CPU, one model without a shortlist, a search that takes
        sentences midway (decoding.Running.takes), no alignments, prefixes, constraints or
        languages asked. Not on a GPU until one has measured it."""
        return (
            self.capacity().running
            and not options.alignments
            and not any(prefixes or [])
            and not any(constraints or [])
            # language tokens (a multilingual model's, a many-to-many run's --tgt-lang) go in and
            # out in hypotheses()
            and self.languages is None
            and not (options.src_lang or options.tgt_lang)
            and cast(Any, self.backend).joins(options)
        )

    def capacity(self) -> Capacity:
        """How a server may decode batches side by side (serve/contract.py)."""
        if self.engine == "ctranslate2":
            backend = cast(Any, self.backend)
            return Capacity(workers=backend.workers, spare=backend.spare)
        return Capacity(running=self._nmt_on_cpu() and hasattr(self.backend, "joins"))

    def search_in_callers(self, threads: int) -> None:
        """nmt's engine: each search in its caller's thread, on `threads` CPU threads (0: all), for
        a server whose searches step in turn (no worker thread holding a turn it no longer uses)."""
        if self.engine == "nmt":
            cast(Any, self.backend).caller_threads = threads

    def running(self, options: DecodeOptions):
        """A running batch for sentences with `options` (but for the seed, alpha and length
        limits: DecodeOptions.joint): ids join it between its steps and leave as they end
        (decoding.Running; `nmt serve`)."""
        if not self.joins(options):
            raise ValueError("these options or this engine take no running batch")
        self.check_tag(options.tag)
        return cast(Any, self.backend).running(options)

    def work_of(
        self,
        lengths: list[int],
        options: DecodeOptions,
        forced: list[list[int]] | None = None,
        phrases: list[list[list[int]]] | None = None,
    ) -> list[int]:
        """The work (costs) of sentences of `lengths` pieces, with those prefixes and constraints (ids)."""
        ceiling = min(self.max_src, options.max_len or self.max_src)
        found = limits(lengths, options.max_len_a, options.max_len_b, ceiling, forced, phrases)
        return [options.rows * n if length else 0 for n, length in zip(found, lengths)]
