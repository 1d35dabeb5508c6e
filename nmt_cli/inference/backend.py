"""What a translation's search runs on: the protocol both backends keep (nmt's own engine,
backend_nmt.py; CTranslate2, backend_ct2.py; mypy checks each against it), and which of them a
model and the settings choose."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.engine.hypothesis import Hypothesis, Source
from nmt_cli.errors import NmtError
from nmt_cli.inference import models
from nmt_cli.inference.description import described
from nmt_cli.inference.models import Model


@dataclass(frozen=True)
class Capacity:
    """How many batches a decoder's own workers decode side by side (CTranslate2: one per CPU
    thread, each batch whole; nmt's engine: 1, its batches stepping in turn instead), how many
    spare workers only batches of long sentences take, and whether it has running batches that
    sentences join between steps (`Decoder.running`; which sentences: `Decoder.joins`)."""

    workers: int = 1
    spare: int = 0
    running: bool = False


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


@dataclass(frozen=True)
class Choice:
    """The engine a translator runs and why: `--verbose` says it, the server's /health shows it."""

    engine: str  # "nmt" or "ctranslate2"
    why: str

    def __str__(self) -> str:
        return f"{self.engine} ({self.why})"


# Why --engine auto takes CTranslate2 where it may: it decodes this project's models faster on
# a CPU than nmt's engine and gives the same translations (docs/benchmarks.md, "Engines").
FASTER = "auto: CTranslate2 does every option asked, faster on a CPU"


def refusal(engine: str, options: DecodeOptions, constraints: bool = False) -> str | None:
    """What of `options` (and lexical constraints, where given) `engine` cannot do, in a few
    words; None where it does them all. The one list of what CTranslate2 lacks: the CLI, the
    Python API and the server refuse by it, and --engine auto routes by it."""
    if engine != "ctranslate2":
        return None
    if constraints:
        return "--constraints need nmt's engine"
    if options.epsilon:
        return "CTranslate2 has no --epsilon sampling"
    return None


def nmt_only(options: DecodeOptions, constraints: bool = False) -> str | None:
    """Why --engine auto decodes `options` (and constraints, where given) with nmt's engine, if
    it must: what CTranslate2 lacks, and sampling, whose draws nmt's engine seeds line by line."""
    lacking = refusal("ctranslate2", options, constraints)
    if lacking:
        return lacking
    if options.sample:  # CTranslate2 seeds one random stream per thread, not one per line
        return "--sample: nmt's engine draws each line from its own seed"
    return None


def _wants_nmt(config: TranslateConfig, constraints: bool, procs: int) -> str | None:
    """Why --engine auto keeps nmt's engine for these settings and command, if it must."""
    why = nmt_only(config.decode, constraints)
    if why:
        return why
    if not config.cuda_graphs:
        return "--no-cuda-graphs is nmt's engine's"
    if config.precision not in ("auto", "fp32"):  # CTranslate2's bf16 needs what a CPU may lack
        return f"--precision {config.precision}: nmt's engine's on a CPU"
    if procs > 1:
        return "--procs is nmt's engine's"
    try:
        import ctranslate2
    except ImportError:
        return "CTranslate2 is not installed"
    if config.device.startswith("cuda") or (
        config.device == "auto" and ctranslate2.get_cuda_device_count() > 0
    ):  # until a GPU has measured CTranslate2 against nmt's engine and its CUDA graphs
        return "a GPU"
    return None


def choose(model: Model, config: TranslateConfig, constraints: bool = False, procs: int = 1) -> Choice:
    """The engine that decodes `model` with `config`: the one asked for (--engine, --int8), a
    CTranslate2 export's own, else (auto) CTranslate2 wherever it is installed and does all that
    is asked, on a CPU, nmt's engine otherwise. `constraints`: whether lines come with lexical
    constraints; `procs`: the worker processes asked for (--procs). One error line where what
    is asked cannot be met."""
    forced = "--int8" if config.int8 else "--engine ctranslate2"
    if model.members:
        if config.engine == "ctranslate2" or config.int8:
            raise NmtError("an ensemble is decoded by nmt's engine: drop --engine ctranslate2 and --int8")
        return Choice("nmt", "an ensemble")
    export = model.ct2_dir is not None and not model.converted
    if export and config.engine == "nmt":
        raise NmtError(
            f"{model.where} is a CTranslate2 export: use --engine ctranslate2 (or translate from "
            "an nmt package or the run directory)"
        )
    if export:
        chosen, remedy = Choice("ctranslate2", "a CTranslate2 export"), "decode the nmt package or run"
    elif config.engine == "nmt":
        chosen, remedy = Choice("nmt", "--engine nmt"), ""
    elif config.int8 or config.engine == "ctranslate2":
        chosen, remedy = Choice("ctranslate2", forced), f"drop {forced}"
    else:
        why = _wants_nmt(config, constraints, procs)
        chosen, remedy = Choice("nmt", f"auto: {why}") if why else Choice("ctranslate2", FASTER), ""
    if chosen.engine == "nmt":
        if model.converted:  # loaded() hands a conversion over only where CTranslate2 decodes
            raise NmtError(f"{model.where}: its CTranslate2 conversion was loaded, and {chosen} decodes")
        return chosen
    lacking = refusal("ctranslate2", config.decode, constraints)
    if lacking:
        raise NmtError(f"{lacking}: {remedy}")
    return chosen


def loaded(
    run_dir: Path,
    paths: list[Path] | None,
    checkpoint: str | None,
    config: TranslateConfig,
    constraints: bool = False,
    procs: int = 1,
    weights: bool = True,
) -> tuple[Model, Choice]:
    """The model of --model or the run (models.load), for the engine chosen for it (`choose`):
    where CTranslate2 decodes a model whose conversion is kept (ct2_cache.py), that conversion,
    and neither the model's weights nor torch are loaded. `weights`: False where nmt's engine
    decodes in worker processes that load the model themselves (description.described)."""
    from nmt_cli.inference import ct2_cache

    found = described(run_dir, paths, checkpoint)
    choice = choose(found, config, constraints, procs)
    if choice.engine == "ctranslate2" and found.ct2_dir is None:
        kept = ct2_cache.cached(found)
        if kept is not None:
            return kept, choice
    return (models.load(run_dir, paths, checkpoint) if weights else found), choice
