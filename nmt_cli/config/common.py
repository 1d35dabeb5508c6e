"""What every config shares: fields that are also command-line options, the JSON round trip, and
the device, the CPUs and the number format a command resolves."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import TYPE_CHECKING, Any, TypeVar

from nmt_cli.errors import NmtError


def knob(default: Any, help: str) -> Any:
    """A config field that is also a command-line option: `help` is its --help text, written
    only here (the CLI reads it: cli/options.about)."""
    return dataclasses.field(default=default, metadata={"help": help})


PRECISIONS = ("auto", "fp32", "tf32", "bf16", "fp16")
LANGUAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")


def language(value: Any, where: str) -> str:
    """`value` if it is a language code (en, de, zh_Hant, deu_Latn), else one error line naming
    `where` (an option, or a file's field): a language becomes part of file names and commands."""
    if not isinstance(value, str) or not LANGUAGE.fullmatch(value):
        raise NmtError(f"{where} is {value!r:.40}, not a language code (letters, digits, _ and -)")
    return value


def resolve_device_name(name: str, gpu: bool) -> str:
    """--device where `gpu` says whether a CUDA GPU is visible: auto is the GPU if there is one.
    A GPU always comes with its index (`cuda` is `cuda:0`): torch's calls that act on "the
    current GPU" take the thread's, which a worker or a server's thread has not set, so every
    device handed out says which GPU it is. Torch-free, so that CTranslate2 (which counts GPUs
    itself) shares it with nmt's engine."""
    if name == "auto":
        name = "cuda" if gpu else "cpu"
    if name.startswith("cuda") and not gpu:
        raise NmtError(f"--device {name}: no CUDA GPU is visible here; use --device cpu")
    if name == "cuda":
        return "cuda:0"
    if name.startswith("cuda:") and not name[5:].isdigit():
        raise NmtError(f"unknown --device {name!r}: use auto, cpu, cuda or cuda:N")
    return name


def cpus() -> int:
    """The CPUs this process may run on (all of them where the OS cannot say, as on macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def resolve_precision(
    precision: str, device_type: str, cpu_bf16: bool = False, decoding: bool = False
) -> str:
    """--precision on a device of `device_type` ("cpu", "cuda"). auto: on a GPU bf16 for training
    and fp32 for decoding, where bf16 scored level with fp32 on the validation set but decoded
    several times slower (benchmarks/deploy.py fidelity --precisions); on a CPU bf16 when `cpu_bf16` (it
    has bf16 arithmetic and the caller gains from it), else fp32."""
    if precision == "auto":
        if device_type == "cuda":
            return "fp32" if decoding else "bf16"
        return "bf16" if cpu_bf16 else "fp32"
    if precision == "fp16" and device_type != "cuda":
        raise NmtError("--precision fp16 needs a GPU; on the CPU use bf16 or fp32")
    if precision == "tf32" and device_type != "cuda":
        raise NmtError(
            "--precision tf32 (fp32 on a GPU's TensorFloat-32 cores) needs a GPU; on the CPU use fp32"
        )
    return precision


if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


def to_json(config: Any) -> str:
    return json.dumps(dataclasses.asdict(config), indent=2) + "\n"


def from_json(cls: type[C], text: str, source: str = "config") -> C:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise NmtError(f"{source} is not valid JSON: {e}") from None
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise NmtError(f"{source} has unknown keys {unknown} for {cls.__name__}")
    return cls(**data)


# How COMET models compute (comet.py), alike wherever one is taken (score, translate, train)
COMET_PRECISION_HELP = (
    "fp32 (COMET's own scores) or bf16 (the encoder's products in bf16: faster on a CPU with bf16 "
    "arithmetic and on a GPU; the scores move)."
)
COMET_PRECISIONS = ("fp32", "bf16")
