"""What the server needs of a translator, typed: `Decoder`. inference.translator.Translator
keeps it (mypy checks so where serve/app.py hands one to the batcher); the tests' stand-ins
imitate it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.engine.hypothesis import Hypothesis
from nmt_cli.inference.backend import Capacity


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
