"""What `nmt import` read from a Hugging Face folder: read.py makes it, trim.py cuts its
vocabulary, read.py writes it as a package."""

from __future__ import annotations

from dataclasses import dataclass, field

from nmt_cli.config import ModelConfig


@dataclass
class Marian:
    """What `nmt import` read from a MarianMTModel folder."""

    config: ModelConfig
    weights: dict  # nmt's names
    source: bytes  # the sentencepiece models, with nmt's ids
    target: bytes
    files: dict[str, str]  # the folder's files read, with their sha256
    tokenizer: dict  # its tokenizer_config.json (empty where it has none)
    languages: dict[str, str] = field(default_factory=dict)  # M2M100, NLLB: code -> token
