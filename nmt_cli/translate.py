"""`nmt translate`: read, clean, encode, length-sort, search, restore order, detokenize, write.

A Unix filter that streams: it translates what has arrived as soon as input pauses (a line
typed into a pipe is answered at once) and at most `chunk` lines at a time (a file goes in
large length-sorted batches), writing the translations in input order before reading on, so
memory stays bounded however long the input. Every input line gives exactly one output line
(nbest > 1: `nbest` lines of line-number, score, text).

Two backends search the same way (`Backend`): nmt's own engine (backend_nmt.py) and CTranslate2
(backend_ct2.py), on a run's model, a package or a CTranslate2 export (models.py).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol, TextIO

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.engine.hypothesis import Hypothesis
from nmt_cli.errors import NmtError
from nmt_cli.models import Model
from nmt_cli.normalize import normalize
from nmt_cli.textio import Damage, decode_line

# Characters that some readers take for a line break: an output line must stay one line.
ONE_LINE = str.maketrans({c: " " for c in "\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})
# How long input may pause before what has arrived is translated: short for a person at a pipe,
# long beside the microseconds between the lines of a file.
PAUSE = 0.02  # seconds


class Backend(Protocol):
    """What searches for translations: nmt's own engine or CTranslate2."""

    def search(
        self, batches: list[list[list[int]]], options: DecodeOptions
    ) -> Iterator[list[list[Hypothesis]]]:
        """The `options.nbest` best hypotheses of each sentence of each batch (source ids
        without EOS), best first, batch by batch in order."""
        ...


def engine_of(model: Model, config: TranslateConfig) -> str:
    if model.members:
        if config.engine == "ctranslate2" or config.int8:
            raise NmtError("an ensemble is decoded by nmt's engine: drop --engine ctranslate2 and --int8")
        return "nmt"
    if model.ct2_dir is not None:
        if config.engine == "nmt":
            raise NmtError(
                f"{model.where} is a CTranslate2 export: use --engine ctranslate2 (or "
                "translate from an nmt package or the run directory)"
            )
        return "ctranslate2"
    if config.int8:
        return "ctranslate2"
    return "nmt" if config.engine == "auto" else config.engine


@dataclass
class Counts:
    lines: int = 0
    truncated: int = 0
    damage: Damage = dataclasses.field(default_factory=Damage)


class Translator:
    """A loaded model with its sentencepiece model, translating lists of raw lines."""

    def __init__(self, model: Model, config: TranslateConfig):
        import sentencepiece as spm

        self.config = config
        self.engine = engine_of(model, config)
        self.backend: Backend
        if self.engine == "ctranslate2":  # imported here: neither backend needs the other's
            from nmt_cli import backend_ct2

            self.backend = backend_ct2.Backend(model, config)
        else:
            from nmt_cli import backend_nmt

            self.backend = backend_nmt.Backend(model, config)
        self.sp = spm.SentencePieceProcessor(model_file=str(model.spm))
        if self.sp.get_piece_size() != model.config.vocab_size:
            raise NmtError(
                f"{model.where} has a vocabulary of {model.config.vocab_size} but "
                f"{model.spm} has {self.sp.get_piece_size()}: they are from "
                "different runs"
            )
        self.src_lang = model.src
        # room for the EOS in every model
        self.max_src = min(m.config.max_positions for m in model.parts) - 1
        self.counts = Counts()

    def encode(self, lines: list[str]) -> list[list[int]]:
        cleaned = [normalize(line, self.src_lang) for line in lines]
        ids = self.sp.encode(cleaned, out_type=int)
        for i, x in enumerate(ids):
            if len(x) > self.max_src:
                ids[i] = x[: self.max_src]
                self.counts.truncated += 1
        return ids

    def batches(self, ids: list[list[int]]) -> Iterable[list[int]]:
        """Indices of non-empty sentences, longest first, in batches of bounded size."""
        order = sorted((i for i, x in enumerate(ids) if x), key=lambda i: -len(ids[i]))
        batch: list[int] = []
        for i in order:
            longest = len(ids[batch[0]]) + 1 if batch else len(ids[i]) + 1
            if batch and (
                len(batch) >= self.config.batch_size or longest * (len(batch) + 1) > self.config.max_tokens
            ):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def hypotheses(self, lines: list[str], options: DecodeOptions | None = None) -> list[list[Hypothesis]]:
        """The nbest hypotheses of each line; an empty line gets empty ones. `options` replace
        the config's for this call."""
        options = options or self.config.decode
        ids = self.encode(lines)
        out: list[list[Hypothesis]] = [[Hypothesis([], 0.0)] * options.nbest for _ in lines]
        batches = list(self.batches(ids))
        found = self.backend.search([[ids[i] for i in b] for b in batches], options)
        for batch, hyps in zip(batches, found, strict=True):  # strict: runs `found` to its end
            for i, h in zip(batch, hyps):
                out[i] = h
        return out

    def texts(self, hyps: list[list[Hypothesis]]) -> list[list[str]]:
        """The text of each hypothesis, kept to one line."""
        flat = iter(self.sp.decode([h.tokens for hs in hyps for h in hs]))
        return [[next(flat).translate(ONE_LINE) for _ in hs] for hs in hyps]

    def translate(self, lines: list[str]) -> list[str]:
        """One output line per input line (nbest > 1: nbest lines each)."""
        hyps = self.hypotheses(lines)
        texts = self.texts(hyps)
        if self.config.decode.nbest == 1:
            return [t[0] for t in texts]
        first = self.counts.lines
        return [
            f"{first + i}\t{h.score:.4f}\t{text}"
            for i, (hs, ts) in enumerate(zip(hyps, texts))
            for h, text in zip(hs, ts)
        ]

    def stream(self, source: BinaryIO, sink: TextIO, advance: Callable[[int], None]) -> Counts:
        """Translate `source` line by line into `sink`, in input order, as input arrives."""
        for chunk in arrivals(source, self.config.chunk):
            lines = [
                decode_line(raw, self.counts.lines + i + 1, self.counts.damage) for i, raw in enumerate(chunk)
            ]
            for text in self.translate(lines):
                sink.write(text + "\n")
            sink.flush()
            self.counts.lines += len(chunk)
            advance(len(chunk))
        return self.counts


_END = object()


def arrivals(source: BinaryIO, most: int) -> Iterator[list[bytes]]:
    """The lines of `source` in lists of at most `most`: each list is what arrived before input
    paused for PAUSE seconds (or `most` lines). A thread reads ahead, at most `most` lines."""
    lines: queue.Queue = queue.Queue(maxsize=most)

    def read() -> None:
        try:
            for raw in source:
                lines.put(raw)
            lines.put(_END)
        except BaseException as e:  # noqa: B036 - handed to the reading side, raised there
            lines.put(e)

    threading.Thread(target=read, daemon=True, name="nmt-read").start()
    done = False
    while not done:
        got = [lines.get()]  # wait as long as it takes for the first line
        while len(got) < most:
            try:
                got.append(lines.get(timeout=PAUSE))
            except queue.Empty:
                break
            if got[-1] is _END or isinstance(got[-1], BaseException):
                break
        if got[-1] is _END or isinstance(got[-1], BaseException):
            last = got.pop()
            if isinstance(last, BaseException):
                raise last
            done = True
        if got:
            yield got
