"""`nmt score-pairs` below the CLI: given translations scored pair by pair (forced decoding's
log-probability, or CometKiwi's estimate), and the pairs that score well kept (a noisy corpus
filtered)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from nmt_cli import translate, ui
from nmt_cli.config import TranslateConfig
from nmt_cli.errors import NmtError
from nmt_cli.files import atomic_open
from nmt_cli.inference import comet
from nmt_cli.inference.translator import Translator
from nmt_cli.textio import Counts, Damage, decode_line


@dataclasses.dataclass(frozen=True)
class Keep:
    """`score-pairs --min-score X --kept-src A --kept-tgt B`: the pairs scoring at least X
    (CometKiwi's score with --kiwi, else the log-probability per token), written line-aligned
    to A and B, each file whole or not at all."""

    min_score: float
    src: Path
    tgt: Path

    @staticmethod
    def of(min_score: float | None, src: Path | None, tgt: Path | None) -> Keep | None:
        given = (min_score is not None, src is not None, tgt is not None)
        if not any(given):
            return None
        if not all(given):
            raise NmtError("filtering pairs takes --min-score X with --kept-src FILE and --kept-tgt FILE")
        assert min_score is not None and src is not None and tgt is not None
        return Keep(min_score, src, tgt)


@contextlib.contextmanager
def _keeping(keep: Keep | None, total: int, what: str) -> Iterator[Callable[[list, list, list], None]]:
    """A writer of each chunk's (sources, targets, scores) into `keep`'s files; nothing without."""
    if keep is None:
        yield lambda sources, targets, scores: None
        return
    kept = [0]
    with atomic_open(keep.src) as a, atomic_open(keep.tgt) as b:

        def write(sources: list[str], targets: list[str], scores: list[float]) -> None:
            for x, y, s in zip(sources, targets, scores):
                if s >= keep.min_score:
                    a.write(x + "\n")
                    b.write(y + "\n")
                    kept[0] += 1

        yield write
    ui.say(
        f"kept {kept[0]:,} of {total:,} pairs with {what} >= {keep.min_score:g} in {keep.src} and {keep.tgt}"
    )


def score_pairs(translator: Translator, src: Path, tgt: Path, sink: TextIO, keep: Keep | None = None) -> None:
    """`nmt score-pairs`: each pair's scores, one line each, `chunk` pairs at a time."""
    total = _aligned(src, tgt)
    chunks = _pairs(src, tgt, total, translator.config.chunk, translator.counts.damage, "score-pairs")
    with _keeping(keep, total, "log-probability per token") as kept:
        for sources, targets, advance in chunks:
            scored = translator.score_pairs(sources, targets)
            for p in scored:
                sink.write(f"{p.total:.4f}\t{p.per_token:.4f}\t{p.score:.4f}\n")
            sink.flush()
            kept(sources, targets, [p.per_token for p in scored])
            advance(len(sources))
    translate.report_counts(translator.counts, translator.max_src)


def _aligned(src: Path, tgt: Path) -> int:
    """The lines of two files that must be line-aligned; one error line where they are not."""
    lines = [_count_lines(path) for path in (src, tgt)]
    if lines[0] != lines[1]:
        raise NmtError(f"{src} has {lines[0]} lines and {tgt} {lines[1]}: give line-aligned files")
    return lines[0]


def _pairs(
    src: Path, tgt: Path, total: int, chunk: int, damage: Damage, what: str
) -> Iterator[tuple[list[str], list[str], Callable[[float], None]]]:
    """The pairs of two line-aligned files, decoded, `chunk` at a time, each chunk with the
    advance of a progress bar of `total` pairs."""
    with open(src, "rb") as a, open(tgt, "rb") as b, ui.progress() as bar:
        task = bar.add_task(what, total=total)
        pairs = enumerate(zip(a, b), 1)
        while part := list(itertools.islice(pairs, chunk)):
            sources = [decode_line(x, n, damage) for n, (x, _) in part]
            targets = [decode_line(y, n, damage) for n, (_, y) in part]
            yield sources, targets, lambda n: bar.advance(task, n)


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError as e:
        raise NmtError(f"cannot read {path}: {e.strerror}") from None


def kiwi_pairs(
    config: TranslateConfig, src: Path, tgt: Path, sink: TextIO, keep: Keep | None = None, chunk: int = 10_000
) -> None:
    """`nmt score-pairs --kiwi`: CometKiwi's score of each pair, one line each, `chunk` pairs
    at a time (each chunk's sentences batched by length)."""
    total = _aligned(src, tgt)  # before the model is read
    folder = str(config.kiwi)
    model = comet.load(folder, config.comet_precision, config.device)
    if model.hparams.needs_reference:
        raise NmtError(f"{folder} is a reference-based model: --kiwi takes a CometKiwi model")
    chunks = _pairs(src, tgt, total, chunk, Counts().damage, "score-pairs --kiwi")
    with _keeping(keep, total, "CometKiwi") as kept:
        for sources, targets, advance in chunks:
            scores = model.score(targets, sources, progress=advance)
            for value in scores:
                sink.write(f"{value:.4f}\n")
            sink.flush()
            kept(sources, targets, scores)
