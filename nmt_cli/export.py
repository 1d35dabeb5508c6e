"""`nmt export` below the CLI: a model written into one directory, as an nmt package (with its
CTranslate2 conversion kept beside it), a CTranslate2 model or a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

from nmt_cli import ui
from nmt_cli.errors import NmtError
from nmt_cli.inference import models, packages, shortlist

FORMATS = ("nmt", "ctranslate2", "huggingface")


def export(
    run_dir: Path, model: list[Path] | None, checkpoint: str | None, out: Path, fmt: str, quantization: str
) -> tuple[str, str]:
    """Write the model of `run_dir` (or `model`) to `out` in `fmt`: what was done, and the
    command that uses it next."""
    if model and len(model) > 1:
        raise NmtError("export takes one --model (an ensemble's members are exported one by one)")
    if fmt not in FORMATS:
        raise NmtError(f"unknown --format {fmt!r}: choose nmt, ctranslate2 or huggingface")
    if quantization != "float32" and fmt != "ctranslate2":
        raise NmtError("--quantization is for --format ctranslate2")
    found = models.load(run_dir, model, checkpoint)
    if not model and found.shortlist is None and fmt != "huggingface":  # a run binarized before them
        from nmt_cli.rundir import RunDir

        found.shortlist = shortlist.for_run(RunDir(run_dir))
    if fmt == "nmt":
        packages.export_nmt(found, out)
        _convert_ahead(out)
    elif fmt == "ctranslate2":
        packages.export_ct2(found, out, quantization)
    else:
        from nmt_cli.hf.write import export_huggingface

        export_huggingface(found, out)
        return (
            f"exported {found.where} to {out} in the Hugging Face format",
            f"AutoModelForSeq2SeqLM.from_pretrained({str(out)!r}), or nmt import {out} PACKAGE",
        )
    return f"exported {found.where} to {out}", f"nmt translate --model {out} < input.txt"


def _convert_ahead(package: Path) -> None:
    """The package's CTranslate2 conversion, kept beside it now (ct2_cache.py), so that the first
    `nmt translate` of it starts as fast as the next; nothing where CTranslate2 is not installed."""
    from nmt_cli.inference import ct2_cache

    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return
    converted, _ = ct2_cache.converted(models.from_dir(package))
    ui.verbose(f"kept its CTranslate2 conversion in {converted.ct2_dir}")
