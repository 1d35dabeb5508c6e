"""What a COMET model folder holds (comet.py computes with it), read without trusting it: the
hyperparameters (the checkpoint's own copy, else hparams.yaml), the weights of the Lightning
checkpoint (weights only: Lightning's attribute dictionary is the one class allowed), and the
encoder's folder, whose config must describe no more weights than the checkpoint holds before
any are allocated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nmt_cli.errors import NmtError

ESTIMATORS = ("regression_metric", "referenceless_regression_metric", "unified_metric")
LIGHTNING_DICTS = (  # where Lightning has kept its hyperparameter dictionary over the years
    "pytorch_lightning.utilities.parsing.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "lightning.fabric.utilities.data.AttributeDict",
)
HPARAMS_BYTES = 1 << 20


@dataclass(frozen=True)
class Hparams:
    """What of hparams.yaml (or the checkpoint's own copy) shapes the computation."""

    estimator: str
    pretrained_model: str
    layer: str | int  # "mix", or one layer's index
    layer_transformation: str  # softmax or sparsemax
    layer_norm: bool
    pool: str  # avg, max, cls, default (regression metrics; unified takes the first position)
    hidden_sizes: tuple[int, ...]
    activations: str
    final_activation: str | None
    input_segments: tuple[str, ...]

    @classmethod
    def of(cls, raw: dict, where: Path) -> Hparams:
        estimator = raw.get("class_identifier")
        if estimator not in ESTIMATORS:
            raise NmtError(
                f"{where}: a COMET model of class {estimator!r}, which nmt does not compute "
                f"(it computes {', '.join(ESTIMATORS)})"
            )
        if raw.get("encoder_model", "XLM-RoBERTa") != "XLM-RoBERTa":
            raise NmtError(f"{where}: encoder {raw.get('encoder_model')!r}; nmt computes XLM-RoBERTa's")
        unified = estimator == "unified_metric"
        layer = raw.get("sent_layer" if unified else "layer", "mix")
        transformation = raw.get("layer_transformation", "softmax")
        if transformation == "sparsemax_patch":  # unbabel-comet >= 2.2.4 reads it as softmax
            transformation = "softmax"
        if transformation not in ("softmax", "sparsemax"):
            raise NmtError(f"{where}: layer_transformation {transformation!r} (softmax or sparsemax)")
        pool = raw.get("pool", "avg")
        if pool not in ("avg", "max", "cls", "default"):
            raise NmtError(f"{where}: pool {pool!r} (avg, max, cls or default)")
        if raw.get("word_level_training"):
            raise NmtError(f"{where}: a word-level model (XCOMET's error spans), which nmt does not compute")
        segments = tuple(raw.get("input_segments") or (("mt", "src") if unified else ()))
        return cls(
            estimator=estimator,
            pretrained_model=str(raw.get("pretrained_model", "xlm-roberta-large")),
            layer=layer if layer == "mix" else int(layer),
            layer_transformation=transformation,
            layer_norm=bool(raw.get("layer_norm", True)),
            pool=pool,
            hidden_sizes=tuple(int(x) for x in raw.get("hidden_sizes", (3072, 1024))),
            activations=str(raw.get("activations", "Tanh")),
            final_activation=raw.get("final_activation"),
            input_segments=segments,
        )

    @property
    def needs_reference(self) -> bool:
        if self.estimator == "unified_metric":
            return "src" not in self.input_segments
        return self.estimator == "regression_metric"

    @property
    def takes_reference(self) -> bool:
        return self.estimator == "regression_metric" or "ref" in self.input_segments


def read_hparams(folder: Path) -> dict:
    """hparams.yaml, at most HPARAMS_BYTES; one line where it is not a YAML mapping."""
    import yaml

    from nmt_cli.files import read_regular

    path = folder / "hparams.yaml"
    try:
        raw = yaml.safe_load(read_regular(path, HPARAMS_BYTES).decode("utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise NmtError(f"{path} could not be read ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise NmtError(f"{path} is not a YAML mapping of hyperparameters")
    return raw


def read_checkpoint(path: Path) -> tuple[dict[str, Tensor], dict]:
    """The weights and the hyperparameters of a Lightning checkpoint, unpickling nothing but
    tensors, containers, numbers, strings and Lightning's attribute dictionary."""
    from nmt_cli.files import check_torch_zip

    with path.open("rb") as f:
        check_torch_zip(f, path)
        allowed: list[Any] = [(dict, name) for name in LIGHTNING_DICTS]  # read as the plain dict it is
        try:
            with torch.serialization.safe_globals(allowed):
                # mapped, not read: every member is stored whole within the file (checked
                # above), so no tensor can hold more bytes than the file has
                data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is the file's
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "Unsupported global" in str(e):
                first = next((x.strip() for x in str(e).splitlines() if "Unsupported global" in x), first)
            raise NmtError(f"{path} could not be read as weights only ({first[:200]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("state_dict"), dict):
        raise NmtError(f"{path} is not a COMET checkpoint: it holds no state_dict")
    state = data["state_dict"]
    if not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise NmtError(f"{path}: its state_dict holds something other than named tensors")
    hyper = data.get("hyper_parameters") or {}
    return state, dict(hyper) if isinstance(hyper, dict) else {}


def encoder_dir(folder: Path, pretrained: str) -> Path:
    """Where the encoder's config and tokenizer are: hparams' `pretrained_model` as a path, or
    its last part inside the model folder or beside it, or the model folder itself."""
    name = pretrained.rstrip("/").split("/")[-1]
    for candidate in (Path(pretrained), folder / pretrained, folder / name, folder.parent / name, folder):
        if (candidate / "config.json").is_file():
            return candidate
    raise NmtError(
        f"{folder}: its encoder {pretrained!r} is not here: put the encoder's config.json and tokenizer "
        f"files in {folder / name} (e.g. `hf download {pretrained} config.json tokenizer.json "
        f"sentencepiece.bpe.model --local-dir {folder / name}`)"
    )


def check_encoder(encoder: Path, ckpt: Path) -> None:
    """Refuse an encoder config that describes more weights than the checkpoint could hold (in
    half precision at the least), counted on the meta device: a config is a few bytes and would
    otherwise allocate whatever it declares."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    try:
        config = XLMRobertaConfig.from_pretrained(str(encoder), local_files_only=True)
        with torch.device("meta"):
            count = sum(p.numel() for p in XLMRobertaModel(config, add_pooling_layer=False).parameters())
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        raise NmtError(
            f"{encoder}/config.json does not describe an XLM-R encoder ({type(e).__name__})"
        ) from None
    if 2 * count > ckpt.stat().st_size:
        raise NmtError(
            f"{encoder}/config.json describes {count:,} weights, more than {ckpt} holds: "
            "the encoder is not this model's"
        )
