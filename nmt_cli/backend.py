"""What a translation's search runs on: the protocol both backends keep (nmt's own engine,
backend_nmt.py; CTranslate2, backend_ct2.py; mypy checks each against it), and which of them a
model and the settings choose."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.engine.hypothesis import Hypothesis, Source
from nmt_cli.errors import NmtError
from nmt_cli.models import Model


class Backend(Protocol):
    """What searches for translations: nmt's own engine or CTranslate2."""

    def search(
        self,
        batches: list[list[Source]],
        options: DecodeOptions,
        gone: list[Callable[[], list[bool]]] | None = None,
    ) -> Iterator[list[list[Hypothesis]]]:
        """The `options.nbest` best hypotheses of each sentence of each batch, best first, batch
        by batch in order; each beginning with its prefix and holding its constraints. `gone`:
        each batch's, for each of its sentences whether nobody waits for it any more: such a
        sentence's rows stop as soon as they can, and once that is every sentence, the search
        raises errors.Stopped."""
        ...

    def score(self, batches: list[list[list[int]]], targets: list[list[list[int]]]) -> Iterator[list[float]]:
        """The log-probability of each target (ids without EOS, its EOS counted) given its
        source, batch by batch in order."""
        ...

    def align(
        self, batches: list[list[list[int]]], targets: list[list[list[int]]]
    ) -> Iterator[list[list[tuple[int, int]]]]:
        """Each target's (source position, target position) pairs: each target token (ids
        without EOS) with the source token the last decoder layer's attention to the source
        (heads averaged) weighs most when it is predicted, batch by batch in order."""
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
