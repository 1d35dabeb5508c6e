"""COMET and CometKiwi (Rei et al. 2020, 2022): neural metrics read from the checkpoints Unbabel
publishes, computed as unbabel-comet 2.2 computes them, on transformers' XLM-R encoder.

A model is a folder as the Hugging Face hub holds it: `checkpoints/model.ckpt` (a PyTorch
Lightning checkpoint) and `hparams.yaml`, plus its encoder's config and tokenizer (the folder
that hparams' `pretrained_model` names, e.g. `xlm-roberta-large`, inside the model's folder or
beside it). nmt never reaches a hub, and never unpickles an object it does not know: the
checkpoint is read as weights, with Lightning's attribute dictionary as the one class allowed.

unbabel-comet itself cannot be installed beside nmt (it pins numpy<2, protobuf<5 and
transformers<5); benchmarks/peers/comet_score.py runs it in a venv of its own, and the tests hold
nmt's scores to what it computed (tests/data/comet_expected.json).

The model folder's files are read in comet_folder.py. Three estimators, by hparams'
`class_identifier`:
- `regression_metric` (COMET-22): source, translation and reference each encoded alone, pooled
  into one vector each, and a feed-forward head over [t; r; t*r; |t-r|; t*s; |t-s|];
- `referenceless_regression_metric` (COMET-QE): the same without the reference, [t; s; t*s; |t-s|];
- `unified_metric` (CometKiwi): translation and source (and reference, where the model takes
  one) encoded together as one sequence, the head over its first position.
The encoder's layers are mixed by learnt weights (softmax or sparsemax), each layer optionally
normalised per sentence first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from nmt_cli.engine.device import on, resolve_device
from nmt_cli.errors import NmtError
from nmt_cli.inference import comet_folder
from nmt_cli.inference.comet_folder import Hparams

# Padded tokens a batch holds (sentences sorted by length): on a CPU small batches of XLM-R
# large ran faster than large ones, whose activations leave the caches (benchmarks/comet_speed.py)
MAX_TOKENS = 512


def sparsemax(z: Tensor) -> Tensor:
    """The Euclidean projection of `z` (one dimension) onto the probability simplex (Martins
    and Astudillo 2016): entmax's sparsemax, which COMET mixes the layers with."""
    ordered, _ = torch.sort(z, descending=True)
    k = torch.arange(1, len(z) + 1, dtype=z.dtype, device=z.device)
    cumulative = ordered.cumsum(0)
    support = int((1 + k * ordered > cumulative).sum())
    tau = (cumulative[support - 1] - 1) / support
    return torch.clamp(z - tau, min=0)


class LayerMix(nn.Module):
    """gamma * sum_k w_k * layer_k, w = softmax or sparsemax of learnt scalars, each layer first
    normalised per sentence over its unmasked positions where `layer_norm`."""

    def __init__(self, layers: int, transformation: str, layer_norm: bool):
        super().__init__()
        self.scalar_parameters = nn.ParameterList([nn.Parameter(torch.zeros(1)) for _ in range(layers)])
        self.gamma = nn.Parameter(torch.ones(1))
        self.transformation, self.layer_norm = transformation, layer_norm

    def forward(self, layers: Sequence[Tensor], mask: Tensor) -> Tensor:
        weights = torch.cat(list(self.scalar_parameters))
        normed = sparsemax(weights) if self.transformation == "sparsemax" else torch.softmax(weights, dim=0)
        if self.layer_norm:
            layers = [_normed(x, mask.float()) for x in layers]
        # in COMET's order: a sum from 0, one weighted layer at a time
        return self.gamma * sum(w * x for w, x in zip(torch.split(normed, 1), layers))


def _normed(x: Tensor, mask: Tensor) -> Tensor:
    broadcast = mask.unsqueeze(-1)
    batch, _, width = x.size()
    count = mask.sum(1) * width
    mean = ((x * broadcast).view(batch, -1).sum(1) / count).view(batch, 1, 1)
    variance = (((x * broadcast - mean) * broadcast) ** 2).view(batch, -1).sum(1) / count
    return (x - mean) / torch.sqrt(variance + 1e-12).view(batch, 1, 1)


class Head(nn.Module):
    """COMET's feed-forward estimator: Linear, activation, (dropout) per hidden size, then one
    output; named as COMET's state dict names it (`ff.0`, `ff.3`, ...)."""

    def __init__(self, width: int, hidden: Sequence[int], activation: str, final: str | None):
        super().__init__()
        modules: list[nn.Module] = []
        for size in hidden:
            modules += [nn.Linear(width, size), _activation(activation), nn.Dropout(0.0)]
            width = size
        modules.append(nn.Linear(width, 1))
        if final is not None:
            modules.append(_activation(final))
        self.ff = nn.Sequential(*modules)

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x).view(-1)


def _activation(name: str) -> nn.Module:
    if not hasattr(nn, name.title()):
        raise NmtError(f"a COMET head with activation {name!r}, which torch does not have")
    return getattr(nn, name.title())()


class Comet(nn.Module):
    """A COMET model, ready to score: `score(translations, sources, references)`."""

    def __init__(self, hparams: Hparams, encoder_dir: Path, where: Path):
        super().__init__()
        from transformers import AutoTokenizer, XLMRobertaConfig, XLMRobertaModel

        self.hparams, self.where = hparams, where
        self.sha256 = ""  # the checkpoint's, set by load()
        self.precision = "fp32"  # or bf16: the encoder's matrix products under bf16 autocast
        self.device = torch.device("cpu")  # a GPU with its index, set by load()
        config = XLMRobertaConfig.from_pretrained(str(encoder_dir), local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir), local_files_only=True)
        self.encoder = XLMRobertaModel(config, add_pooling_layer=False)
        self.layers = config.num_hidden_layers + 1
        self.max_positions = config.max_position_embeddings - 2
        self.layerwise_attention = (
            LayerMix(self.layers, hparams.layer_transformation, hparams.layer_norm)
            if hparams.layer == "mix"
            else None
        )
        inputs = {"regression_metric": 6, "referenceless_regression_metric": 4, "unified_metric": 1}
        width = config.hidden_size * inputs[hparams.estimator]
        self.estimator = Head(width, hparams.hidden_sizes, hparams.activations, hparams.final_activation)
        self.eval()

    @property
    def name(self) -> str:
        return self.where.name

    # -- encoding
    def _tokens(self, lines: list[str]) -> list[list[int]]:
        out = self.tokenizer(lines, truncation=True, max_length=self.max_positions - 2)
        return [list(x) for x in out["input_ids"]]

    def _mixed(self, layers: Sequence[Tensor], mask: Tensor) -> Tensor:
        if self.layerwise_attention is not None:
            return self.layerwise_attention(layers, mask)
        if not 0 <= int(self.hparams.layer) < self.layers:
            raise NmtError(f"{self.where}: layer {self.hparams.layer} of an encoder of {self.layers}")
        return layers[int(self.hparams.layer)]

    def _layers(self, ids: Tensor, mask: Tensor) -> Sequence[Tensor]:
        """The embeddings and every layer's output (in fp32: under bf16 the encoder's products
        are bf16, what follows them is not)."""
        bf16 = self.precision == "bf16"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
            out = self.encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        return [x.float() for x in out]

    def _pooled(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Sentence embeddings (regression metrics), as COMET's compute_sentence_embedding."""
        layers = self._layers(ids, mask)
        mixed = self._mixed(layers, mask)
        pool = self.hparams.pool
        if pool == "default":  # the last layer's first position, unmixed
            return layers[-1][:, 0]
        if pool == "cls":
            return mixed[:, 0]
        padding = ids.eq(self.tokenizer.pad_token_id).unsqueeze(-1)
        if pool == "max":
            return mixed.float().masked_fill(padding, float("-inf")).type_as(mixed).max(dim=1)[0]
        summed = mixed.float().masked_fill(padding, 0.0).type_as(mixed).sum(1)
        return summed / mask.unsqueeze(-1).expand(mixed.size()).float().sum(1)

    def embed(self, lines: list[str], progress: Callable[[float], None] | None = None) -> Tensor:
        """One pooled vector per line (regression metrics), batched by length."""
        ids = self._tokens(lines)
        out: list[Tensor | None] = [None] * len(lines)
        for batch in _by_length([len(x) for x in ids]):
            padded, mask = self._padded([ids[i] for i in batch])
            with torch.inference_mode(), on(self.device):
                vectors = self._pooled(padded, mask)
            for i, v in zip(batch, vectors):
                out[i] = v
            if progress is not None:
                progress(len(batch))
        return torch.stack(out) if out else self._placed(torch.zeros(0))  # type: ignore[arg-type]

    def _padded(self, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        """The rows padded into one batch, and its mask, on the model's device."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        for n, r in enumerate(rows):
            ids[n, : len(r)] = torch.tensor(r)
        mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
        return self._placed(ids), self._placed(mask)

    def _placed(self, x: Tensor) -> Tensor:
        """A tensor made on the CPU, on the model's device."""
        return x.to(self.device)

    # -- scores
    def head(self, mt: Tensor, src: Tensor | None, ref: Tensor | None) -> Tensor:
        """The regression head over pooled embeddings (rows alike in number, or broadcast)."""
        parts: tuple[Tensor, ...]
        if self.hparams.estimator == "regression_metric":
            assert src is not None and ref is not None
            parts = (mt, ref, mt * ref, torch.abs(mt - ref), mt * src, torch.abs(mt - src))
        else:
            assert src is not None
            parts = (mt, src, mt * src, torch.abs(mt - src))
        with torch.inference_mode(), on(self.device):
            return self.estimator(torch.cat(parts, dim=1)).cpu()

    def mbr_utilities(self, sources: list[str], candidates: list[list[str]]) -> list[Tensor]:
        """For each source, the (K, K) utilities of its K candidates: candidate i scored as the
        translation with candidate j as the reference, exactly as score() would score the pair,
        from one encoding of each candidate and each source (K + 1 encodings, not K^2)."""
        if self.hparams.estimator != "regression_metric":
            raise NmtError(f"{self.name} is not a reference-based COMET model: MBR scores against references")
        pooled = self.embed([c for cs in candidates for c in cs])
        sources_pooled = self.embed(sources)
        out, start = [], 0
        for n, cs in enumerate(candidates):
            k = len(cs)
            mine = pooled[start : start + k]
            start += k
            hyp, ref = mine.repeat_interleave(k, 0), mine.repeat(k, 1)
            out.append(self.head(hyp, sources_pooled[n].expand(k * k, -1), ref).view(k, k))
        return out

    def score(
        self,
        mt: list[str],
        src: list[str] | None = None,
        ref: list[str] | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> list[float]:
        """Each translation's score, as unbabel-comet's `predict` gives it."""
        h = self.hparams
        if h.needs_reference and ref is None:
            raise NmtError(f"{self.name} scores against references: give them")
        if not h.needs_reference and h.estimator != "unified_metric" and src is None:
            raise NmtError(f"{self.name} scores against the sources: give them")
        for other, what in ((src, "sources"), (ref, "references")):
            if other is not None and len(other) != len(mt):
                raise NmtError(f"{len(mt)} translations but {len(other)} {what}: they must be line-aligned")
        if h.estimator == "unified_metric":
            return self._unified(mt, src if "src" in h.input_segments else None,
                                 ref if h.takes_reference else None, progress)  # fmt: skip
        step = (lambda n: progress(n / 3)) if progress is not None else None  # noqa: E731
        t = self.embed(mt, step)
        s = self.embed(src, step) if src is not None else None
        r = self.embed(ref, step) if ref is not None and h.estimator == "regression_metric" else None
        return self.head(t, s, r).tolist()

    def _unified(
        self,
        mt: list[str],
        src: list[str] | None,
        ref: list[str] | None,
        progress: Callable[[float], None] | None,
    ) -> list[float]:
        """CometKiwi and its kin: the translation and the other segments as one sequence each
        (`<s> mt </s></s> src </s>`), the head over the mixed first position; with both source
        and reference, the mean of the three sequences COMET makes (mt+src, mt+ref, all)."""
        segments = [self._tokens(mt)]
        segments += [self._tokens(x) for x in (src, ref) if x is not None]
        if len(segments) == 1:
            raise NmtError(f"{self.name} scores a translation with its source: give the sources")
        combos = [segments] if len(segments) == 2 else [segments[:2], [segments[0], segments[2]], segments]
        totals = torch.zeros(len(mt))
        for combo in combos:
            joined = [self._joined([part[i] for part in combo]) for i in range(len(mt))]
            for batch in _by_length([len(x) for x in joined]):
                ids, mask = self._padded([joined[i] for i in batch])
                with torch.inference_mode(), on(self.device):
                    scores = self.estimator(self._mixed(self._layers(ids, mask), mask)[:, 0]).cpu()
                totals[batch] += scores.float()
                if progress is not None:
                    progress(len(batch) / len(combos))
        return (totals / len(combos)).tolist()

    def _joined(self, parts: list[list[int]]) -> list[int]:
        """COMET's concat_sequences for one row: each part without its own <s> and </s>, joined
        by the tokenizer's pair markers, cut at the encoder's positions when too long."""
        cls, sep = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        sequence = parts[0]
        for part in parts[1:]:  # XLM-R's pair: <s> A </s></s> B </s>
            sequence = [cls, *sequence[1:-1], sep, sep, *part[1:-1], sep]
        special = 1 + len(parts) * 2  # <s> and a separator of two per part
        if sum(len(p) - 2 for p in parts) > self.max_positions - special:
            sequence = sequence[: self.max_positions]
        return sequence

    def signature(self) -> str:
        """What a COMET figure was computed with, as sacreBLEU signs its own."""
        from nmt_cli import __version__

        h = self.hparams
        return (
            f"nmt:{__version__}|comet:{self.name}|sha256:{self.sha256[:12]}|estimator:{h.estimator}"
            f"|batch:{MAX_TOKENS}tok|{self.precision}|{self.device.type}|as:unbabel-comet-2.2.7"
        )


def _by_length(lengths: list[int]) -> Iterator[list[int]]:
    """Indices in batches of similar length, no batch over MAX_TOKENS padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * lengths[i] > MAX_TOKENS:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def load(folder: str | Path, precision: str = "fp32", device: str = "cpu") -> Comet:
    """The COMET model in `folder` (as the hub holds it) on `device` (auto, cpu, cuda:N);
    `precision` fp32 (as unbabel-comet computes) or bf16 (the encoder's products in bf16: faster
    where the CPU has bf16 arithmetic and on a GPU, the scores a little off).

    The model is built without weights and takes the checkpoint's tensors as they lie in the
    file, mapped rather than read, so that the weights are in memory once rather than twice."""
    from nmt_cli.files import sha256_file

    folder = Path(folder)
    if precision not in ("fp32", "bf16"):
        raise NmtError(f"--comet-precision {precision!r}: fp32 or bf16")
    place = resolve_device(device)
    try:
        import transformers  # noqa: F401 - COMET's encoder and tokenizer
    except ImportError:
        raise NmtError("COMET models need transformers: pip install 'nmt-cli[comet]'") from None
    ckpt = folder / "checkpoints" / "model.ckpt"
    if not ckpt.is_file():
        raise NmtError(f"{folder} is not a COMET model folder: no checkpoints/model.ckpt in it")
    state, raw = comet_folder.read_checkpoint(ckpt)
    hparams = comet_folder.Hparams.of(raw or comet_folder.read_hparams(folder), folder)
    encoder = comet_folder.encoder_dir(folder, hparams.pretrained_model)
    comet_folder.check_encoder(encoder, ckpt)
    with torch.device("meta"):
        model = Comet(hparams, encoder, folder)
    weights = {  # a checkpoint's half-precision tensors as the fp32 that COMET computes in
        _our_name(k): v.float() if v.is_floating_point() else v
        for k, v in state.items()
        if not k.endswith("position_ids")
    }
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if missing or unexpected:
        names = (missing or unexpected)[:3]
        raise NmtError(
            f"{ckpt} does not fit the model its hparams describe ({'missing' if missing else 'unexpected'}: "
            f"{', '.join(names)})"
        )
    _rebuild_buffers(model, ckpt)
    model.sha256 = sha256_file(ckpt)
    model.precision = precision
    model.device = place
    return model.to(place)


def _rebuild_buffers(model: Comet, ckpt: Path) -> None:
    """The encoder's buffers that no checkpoint holds (transformers registers them as not
    persistent), made as transformers makes them; any other tensor still without its values is
    the checkpoint's fault."""
    embeddings = model.encoder.embeddings
    positions = model.encoder.config.max_position_embeddings
    for name, value in (
        ("position_ids", torch.arange(positions).expand((1, -1))),
        ("token_type_ids", torch.zeros((1, positions), dtype=torch.long)),
    ):
        if getattr(embeddings, name, None) is not None:
            embeddings.register_buffer(name, value, persistent=False)
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        names = ", ".join(empty[:3])
        raise NmtError(f"{ckpt} does not fit the model its hparams describe (missing: {names})")


def for_choosing(kind: str, path: str | None, precision: str, device: str) -> Comet:
    """What --mbr comet ("comet": --comet) or --rerank kiwi ("kiwi": --kiwi) chooses by."""
    name = "a reference-based COMET" if kind == "comet" else "a CometKiwi"
    flag = "--mbr comet needs --comet DIR" if kind == "comet" else "--rerank kiwi needs --kiwi DIR"
    if not path:
        raise NmtError(f"{flag} ({name} model folder)")
    model = load(path, precision, device)
    if model.hparams.needs_reference != (kind == "comet"):
        raise NmtError(f"{path} is not {name} model: {flag}")
    return model


def _our_name(key: str) -> str:
    """COMET's state-dict name as this module's: its encoder wraps transformers' model."""
    return "encoder." + key[len("encoder.model.") :] if key.startswith("encoder.model.") else key


def system_score(scores: list[float]) -> float:
    """COMET's system score: the mean of the segments'."""
    return math.fsum(scores) / len(scores) if scores else float("nan")
