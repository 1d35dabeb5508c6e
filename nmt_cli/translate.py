"""`nmt translate`: read, clean, encode, length-sort, search, restore order, detokenize, write.

A Unix filter that streams: it reads `chunk` lines at a time and writes their translations,
in input order, before reading on, so memory stays bounded however long the input. Every input
line gives exactly one output line (nbest > 1: `nbest` lines of line-number, score, text).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

import torch

from nmt_cli import bpe
from nmt_cli.config import ModelConfig, TranslateConfig
from nmt_cli.engine import beam, checkpoint
from nmt_cli.engine.device import resolve_device, resolve_precision
from nmt_cli.engine.model import Transformer
from nmt_cli.engine.packing import pack_for_cpu
from nmt_cli.errors import NmtError
from nmt_cli.normalize import normalize
from nmt_cli.rundir import RunDir
from nmt_cli.shards import pad_sources
from nmt_cli.textio import Damage, chunks, decode_line

# Characters that some readers take for a line break: an output line must stay one line.
ONE_LINE = str.maketrans({c: " " for c in "\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def model_path(run: RunDir, explicit: str | None) -> Path:
    """The model to use: --checkpoint, else the averaged model, else the latest checkpoint."""
    if explicit:
        return Path(explicit)
    if run.averaged.exists() and run.averaged.with_suffix(".json").exists():
        return run.averaged
    found = checkpoint.listed(run.checkpoints)
    if not found:
        raise NmtError(f"no model in {run.root}: run `nmt train` (and `nmt average`) first")
    return found[-1]


def load_model(path: Path, device: torch.device, precision: str,
               int8: bool) -> tuple[Transformer, dict]:
    if path.suffix == ".pt" or path.with_suffix(".json").exists():
        tensors, meta = checkpoint.load_tensors(path)
    else:
        raise NmtError(f"{path} is not an nmt model (expected a .pt file with its .json record)")
    model = Transformer(ModelConfig(**meta["model"]))
    try:
        model.load_state_dict({k: v.float() for k, v in tensors["model"].items()})
    except RuntimeError as e:
        raise NmtError(f"{path} does not fit its own model config: {str(e).splitlines()[0]}") from None
    model.eval()
    if int8:
        if device.type != "cpu":
            raise NmtError("--int8 is for the CPU: drop it or use --device cpu")
        import warnings
        with warnings.catch_warnings():  # torch marks eager quantisation as deprecated
            warnings.simplefilter("ignore")
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear},
                                                           dtype=torch.qint8)
    elif precision == "bf16":
        model = model.to(torch.bfloat16)
    elif precision == "fp16":
        model = model.to(torch.float16)
    elif device.type == "cpu":
        model = pack_for_cpu(model)
    return model.to(device), meta


@dataclass
class Counts:
    lines: int = 0
    truncated: int = 0
    damage: Damage = dataclasses.field(default_factory=Damage)


class Translator:
    """A loaded model with its sentencepiece model, translating lists of raw lines."""

    def __init__(self, run: RunDir, config: TranslateConfig):
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = resolve_device(config.device)
        precision = resolve_precision(config.precision, self.device)
        self.path = model_path(run, config.checkpoint)
        self.model, self.meta = load_model(self.path, self.device, precision, config.int8)
        self.sp = bpe.load(run)
        if self.sp.get_piece_size() != self.model.config.vocab_size:
            raise NmtError(f"{self.path} has a vocabulary of {self.model.config.vocab_size} but "
                           f"{run.spm_model} has {self.sp.get_piece_size()}: they are from "
                           "different runs")
        self.src_lang = self.meta.get("src", "en")
        self.max_src = self.model.config.max_positions - 1  # room for the EOS
        self.counts = Counts()

    def encode(self, lines: list[str]) -> list[list[int]]:
        cleaned = [normalize(line, self.src_lang) for line in lines]
        ids = self.sp.encode(cleaned, out_type=int)
        for i, x in enumerate(ids):
            if len(x) > self.max_src:
                ids[i] = x[:self.max_src]
                self.counts.truncated += 1
        return ids

    def batches(self, ids: list[list[int]]) -> Iterable[list[int]]:
        """Indices of non-empty sentences, longest first, in batches of bounded size."""
        order = sorted((i for i, x in enumerate(ids) if x), key=lambda i: -len(ids[i]))
        batch: list[int] = []
        for i in order:
            longest = len(ids[batch[0]]) + 1 if batch else len(ids[i]) + 1
            if batch and (len(batch) >= self.config.batch_size
                          or longest * (len(batch) + 1) > self.config.max_tokens):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def hypotheses(self, lines: list[str]) -> list[list[beam.Hypothesis]]:
        """The nbest hypotheses of each line; an empty line gets one empty hypothesis."""
        ids = self.encode(lines)
        out: list[list[beam.Hypothesis]] = [[beam.Hypothesis([], 0.0)] * self.config.nbest
                                            for _ in lines]
        c = self.config
        for batch in self.batches(ids):
            src = pad_sources([ids[i] for i in batch])
            hyps = beam.translate(self.model, torch.from_numpy(src).to(self.device), beam=c.beam,
                                  alpha=c.alpha, max_len_a=c.max_len_a, max_len_b=c.max_len_b,
                                  nbest=c.nbest)
            for i, h in zip(batch, hyps):
                out[i] = h
        return out

    def translate(self, lines: list[str]) -> list[str]:
        """One output line per input line (nbest > 1: nbest lines each)."""
        hyps = self.hypotheses(lines)
        texts = self.sp.decode([h.tokens for hs in hyps for h in hs])
        if self.config.nbest == 1:
            return texts
        first = self.counts.lines
        return [f"{first + i // self.config.nbest}\t{h.score:.4f}\t{text}"
                for i, (h, text) in enumerate(zip((h for hs in hyps for h in hs), texts))]

    def stream(self, source: BinaryIO, sink: TextIO, advance: Callable[[int], None]) -> Counts:
        """Translate `source` line by line into `sink`, chunk by chunk, in input order."""
        for chunk in chunks(source, self.config.chunk):
            lines = [decode_line(raw, self.counts.lines + i + 1, self.counts.damage)
                     for i, raw in enumerate(chunk)]
            for text in self.translate(lines):
                sink.write(text.translate(ONE_LINE) + "\n")
            sink.flush()
            self.counts.lines += len(chunk)
            advance(len(chunk))
        return self.counts
