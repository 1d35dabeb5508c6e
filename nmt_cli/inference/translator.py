"""The translator under `nmt translate`, `nmt score`, `nmt serve` and the Python API (`Translator`):
read, clean, encode, length-sort, search, restore order, detokenize, write.

A Unix filter that streams: it translates what has arrived as soon as input pauses (a line
typed into a pipe is answered at once) and at most `chunk` lines at a time (a file goes in
large length-sorted batches), writing the translations in input order before reading on, so
memory stays bounded however long the input. Every input line gives exactly one output line;
with scores (--scores, or --nbest above 1), `nbest` lines of line number, score and text.

The search itself is searcher.py's; here are the faces: the Python API (load, translate,
translations, score, stream) and the output of `nmt translate`. What a server asks of it (costs,
capacity, running batches) is serve/contract.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TextIO

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.errors import NmtError
from nmt_cli.inference import backend as engines
from nmt_cli.inference.backend import Choice
from nmt_cli.inference.searcher import PairScore, Searcher, Translation, check_options
from nmt_cli.textio import Counts, requests

__all__ = ["PairScore", "Translation", "Translator", "check_options"]


class Translator(Searcher):
    """A loaded model with its sentencepiece models, translating lists of raw lines."""

    _routed: Translator | None = None  # nmt's engine beside CTranslate2, once a call needs it

    def cuda_graphs(self) -> str | None:
        """Whether nmt's engine on a GPU replays its decoding steps as CUDA graphs: "on", or "off:"
        and why (--no-cuda-graphs, a shortlist, or a recording that failed in this process, after
        which no step is recorded again); None elsewhere."""
        if not self._nmt_on_gpu():
            return None
        from nmt_cli.engine import graphed

        if graphed._failed is not None:
            return f"off: recording failed ({graphed._failed})"
        return "on" if getattr(self.backend, "graphs", None) is not False else "off: not asked for"

    def output(
        self, lines: list[str], prefixes: list[str] | None = None, constraints: list[list[str]] | None = None
    ) -> list[str]:
        """`nmt translate`'s output lines for `lines`: one per line; with scores (--scores, or
        nbest > 1) `nbest` per line, as 'line<TAB>score<TAB>text' (the line numbered from 0)."""
        routed = self.routed(self.config.decode, constraints is not None and any(constraints))
        if routed is not None:
            routed.counts = self.counts  # one count of lines, as one translator's
            return routed.output(lines, prefixes, constraints)
        hyps = self.hypotheses(lines, prefixes=prefixes, constraints=constraints)
        texts = self.texts(hyps)
        o = self.config.decode
        if o.alignments:  # the alignment after the text, tab-separated
            texts = [[f"{t}\t{h.alignment or ''}" for t, h in zip(ts, hs)] for ts, hs in zip(texts, hyps)]
        if o.nbest == 1 and not o.scores:
            return [t[0] for t in texts]
        first = self.counts.lines
        return [
            f"{first + i}\t{h.score:.4f}\t{text}"
            for i, (hs, ts) in enumerate(zip(hyps, texts))
            for h, text in zip(hs, ts)
        ]

    # -- the Python API: Translator.load(...), then translate, translations, score

    @classmethod
    def load(cls, model: str | Path | list[str | Path], **settings) -> Translator:
        """A model ready to translate: a run directory, a package or export from `nmt export`, or
        a checkpoint file (a list: their ensemble). `settings` are `nmt translate`'s options
        (engine="ctranslate2", device="cuda", beam=5, ...): the translation defaults."""
        from nmt_cli.inference import models

        paths = [Path(p) for p in ([model] if isinstance(model, (str, Path)) else model)]
        decoding = {f.name for f in dataclasses.fields(DecodeOptions)}
        unknown = sorted(set(settings) - decoding - {f.name for f in dataclasses.fields(TranslateConfig)})
        if unknown or "decode" in settings:
            raise NmtError(
                f"unknown settings {unknown or ['decode']}: take `nmt translate`'s options, as beam=5"
            )
        decode = DecodeOptions(**{k: v for k, v in settings.items() if k in decoding})
        config = TranslateConfig(decode=decode, **{k: v for k, v in settings.items() if k not in decoding})
        found, choice = engines.loaded(Path("."), paths, None, config)
        original = (lambda: models.load(Path("."), paths, None)) if found.converted else None
        return cls(found, config, choice=choice, original=original)

    def translate(
        self,
        lines: list[str],
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        **options,
    ) -> list[str]:
        """The best translation of each line (beginning with its prefix, holding its
        constraints, if given). `options` (beam=5, sample=True, ...) replace the defaults for
        this call."""
        return [t[0].text for t in self.translations(lines, prefixes, constraints, **options)]

    def translations(
        self,
        lines: list[str],
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        **options,
    ) -> list[list[Translation]]:
        """The `nbest` best translations of each line (or draws, with sample=True), best first,
        each with its score; each beginning with its line of `prefixes` and containing every
        phrase of its list in `constraints`, if given."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(DecodeOptions)})
        if unknown:
            raise NmtError(f"unknown decoding options {unknown}: take `nmt translate`'s, as beam=5")
        decode = dataclasses.replace(self.config.decode, **options)
        for given, what in ((prefixes, "prefix"), (constraints, "list of constraints")):
            if given is not None and len(given) != len(lines):
                raise NmtError(f"{len(lines)} lines but {len(given)} of {what}: give one {what} per line")
        routed = self.routed(decode, constraints is not None and any(constraints))
        if routed is not None:
            return routed.translations(lines, prefixes, constraints, **options)
        hyps = self.hypotheses(lines, decode, list(range(len(lines))), prefixes, constraints)
        texts = self.texts(hyps)
        return [[Translation(t, h.score, h.alignment) for t, h in zip(ts, hs)] for ts, hs in zip(texts, hyps)]

    def routed(self, options: DecodeOptions, constraints: bool) -> Translator | None:
        """Where --engine auto chose CTranslate2 and a call of the Python API asks what is nmt's
        engine's (backend.nmt_only): nmt's engine on the same model, loaded at the first such
        call. The command line chooses knowing its options; the server refuses such a request."""
        if self.engine != "ctranslate2" or not self.choice.why.startswith("auto"):
            return None
        why = engines.nmt_only(options, constraints)
        if why is None:
            return None
        if self._routed is None:
            config = dataclasses.replace(self.config, engine="nmt")
            self._routed = Translator(self._original(), config, choice=Choice("nmt", f"auto: {why}"))
        return self._routed

    def score(self, sources: list[str], targets: list[str]) -> list[PairScore]:
        """How likely the model finds each target as the translation of its source (what
        `nmt score-pairs` prints)."""
        if len(sources) != len(targets):
            raise NmtError(f"{len(sources)} sources but {len(targets)} targets: give one target per source")
        return self.score_pairs(sources, targets)

    def stream(
        self,
        source: BinaryIO,
        sink: TextIO,
        advance: Callable[[int], None],
        prefixes: BinaryIO | None = None,
        constraints: BinaryIO | None = None,
    ) -> Counts:
        """Translate `source` line by line into `sink`, in input order, as input arrives; each
        translation beginning with the line of `prefixes` of the same number and containing
        the tab-separated phrases of the line of `constraints`, where given."""
        for request in requests(source, self.config.chunk, self.counts, prefixes, constraints):
            for text in self.output(request.lines, request.prefixes, request.constraints):
                sink.write(text + "\n")
            sink.flush()
            advance(len(request.lines))
        return self.counts
