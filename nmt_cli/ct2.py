"""The model as CTranslate2 runs it: `nmt export --format ctranslate2` and `--engine ctranslate2`.

The weights go through `ctranslate2.specs.TransformerSpec` one for one: pre- or post-norm
layers, the self-attention's Q/K/V as one fused projection, the encoder-decoder attention's K/V
as one (as nmt computes them), embeddings scaled by sqrt(d_model), our sinusoid table, the tied
output projection, LayerNorm eps 1e-6. The source gets its EOS from CTranslate2
(add_source_eos) and the decoder starts from BOS, as nmt's own search does.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from nmt_cli.config import DecodeOptions, TranslateConfig, resolve_device_name, resolve_precision
from nmt_cli.engine.hypothesis import Hypothesis, length_penalty, max_lengths
from nmt_cli.errors import NmtError
from nmt_cli.files import atomic_write_json, sha256_file
from nmt_cli.package import CT2, SETTINGS, Model, settings, writing
from nmt_cli.vocab import EOS

QUANTIZATIONS = ("float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "float16", "bfloat16")


def require():
    try:
        import ctranslate2
    except ImportError:
        raise NmtError(
            "CTranslate2 is not installed: pip install 'nmt-cli[ct2]' (or pip install ctranslate2)"
        ) from None
    return ctranslate2


def pieces(model: Model) -> list[str]:
    """The vocabulary as CTranslate2 takes it: the sentencepiece pieces, in id order."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model.spm))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def save(model: Model, folder: Path, quantization: str = "float32") -> None:
    """`model` as CTranslate2's model files in `folder`."""
    spec = build_spec(model)
    spec.validate()
    spec.optimize(quantization=None if quantization == "float32" else quantization)
    spec.save(str(folder))


def build_spec(model: Model):
    """A TransformerSpec holding `model`'s weights (float32), with its vocabulary."""
    ct2 = require()
    from nmt_cli.engine.model import sinusoids

    c, w = model.config, {k: v.float().numpy() for k, v in model.load_weights().items()}
    spec = ct2.specs.TransformerSpec.from_config(
        (c.num_encoder_layers, c.num_decoder_layers), c.heads, pre_norm=not c.post_norm
    )
    spec.config.layer_norm_epsilon = 1e-6
    spec.config.add_source_eos = True
    table = sinusoids(c.max_positions, c.d_model).numpy()

    def norm(dst, name: str) -> None:
        dst.gamma, dst.beta = w[f"{name}.weight"], w[f"{name}.bias"]

    def linear(dst, *names: str) -> None:  # several names: fused along the output rows
        dst.weight = np.concatenate([w[f"{n}.weight"] for n in names])
        dst.bias = np.concatenate([w[f"{n}.bias"] for n in names])

    for side, layers in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        embeddings = layers.embeddings[0] if side == "encoder" else layers.embeddings
        embeddings.weight = w["embed.weight"]
        layers.scale_embeddings = True
        layers.position_encodings.encodings = table
        if not c.post_norm:
            norm(layers.layer_norm, f"{side}_norm")
        for i, layer in enumerate(layers.layer):
            p = f"{side}.{i}"
            linear(layer.self_attention.linear[0], f"{p}.self_attn.q", f"{p}.self_attn.kv")
            linear(layer.self_attention.linear[1], f"{p}.self_attn.out")
            norm(layer.self_attention.layer_norm, f"{p}.res1.norm")
            if side == "decoder":
                linear(layer.attention.linear[0], f"{p}.cross_attn.q")
                linear(layer.attention.linear[1], f"{p}.cross_attn.kv")
                linear(layer.attention.linear[2], f"{p}.cross_attn.out")
                norm(layer.attention.layer_norm, f"{p}.res2.norm")
            linear(layer.ffn.linear_0, f"{p}.ffn.inner")
            linear(layer.ffn.linear_1, f"{p}.ffn.outer")
            norm(layer.ffn.layer_norm, f"{p}.res{3 if side == 'decoder' else 2}.norm")
    spec.decoder.projection.weight = w["embed.weight"]
    spec.decoder.projection.bias = np.zeros(c.vocab_size, dtype=np.float32)
    vocabulary = pieces(model)
    spec.register_source_vocabulary(vocabulary)
    spec.register_target_vocabulary(vocabulary)
    return spec


def export(model: Model, out: Path, quantization: str = "float32") -> None:
    """Write `model` as a CTranslate2 model directory, with nmt's text settings beside it."""
    if model.ct2_dir is not None:
        raise NmtError(f"{model.where} is already a CTranslate2 export")
    if quantization not in QUANTIZATIONS:
        raise NmtError(f"unknown --quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    require()
    with writing(model, out) as staging:
        save(model, staging, quantization)
        atomic_write_json(
            staging / SETTINGS,
            settings(model, CT2, sha256_file(staging / "model.bin"), quantization=quantization),
        )


# nmt's --precision as CTranslate2's compute type
COMPUTE_TYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class Engine:
    """Beam search by CTranslate2 on batches of source ids, answering as nmt's search does.
    Nothing here imports torch: a CTranslate2 export starts without it."""

    def __init__(self, model: Model, config: TranslateConfig):
        ct2 = require()
        kind, index = device_of(ct2, config.device)
        if config.int8:
            compute_type = "int8"
        elif config.precision == "auto" and model.ct2_dir is not None:
            compute_type = "default"  # the export's own type
        else:  # converted from an nmt model: fp32 / bf16 as nmt's own engine would choose
            compute_type = COMPUTE_TYPES[resolve_precision(config.precision, kind, decoding=True)]
        threads = config.threads or cpus()
        self._tmp = None
        where = model.ct2_dir
        if where is None:  # convert on the fly, in float32; compute_type quantises on load
            self._tmp = tempfile.TemporaryDirectory(prefix="nmt-ct2-")
            where = Path(self._tmp.name)
            save(model, where)
        try:
            # On a CPU, `threads` workers of one thread each decode `threads` batches at once:
            # CTranslate2's threads within one batch scale poorly on small matrices
            # (docs/benchmarks.md). The workers share the weights.
            cpu = kind == "cpu"
            self.translator = ct2.Translator(
                str(where),
                device=kind,
                device_index=index,
                compute_type=compute_type,
                inter_threads=threads if cpu else 1,
                intra_threads=1 if cpu else threads,
            )
        except (RuntimeError, ValueError) as e:
            raise NmtError(
                f"CTranslate2 cannot load {model.where} on {config.device} as {compute_type}: {e}"
            ) from None
        self.pieces = pieces(model)
        self.ids = {p: i for i, p in enumerate(self.pieces)}
        self.ceiling = model.config.max_positions - 1

    def search(
        self, batches: list[list[list[int]]], options: DecodeOptions
    ) -> Iterator[list[list[Hypothesis]]]:
        """nmt's beam search on each of `batches` (source ids without EOS); the batches are all
        handed over at once, so that every worker has one, and their answers come back in order.

        CTranslate2 divides by |Y| ** alpha where nmt divides by GNMT's ((5 + |Y|) / 6) ** alpha.
        Its search ranks by the raw log-probability and applies the penalty only to finished
        hypotheses, so: ask for all `beam` of them unpenalised, and rank them as nmt does.
        One call has one length limit, the batch's largest (nmt's is each sentence's own; the
        batches hold sentences of close lengths, and a trained model rarely meets its limit).
        """
        beam, a, b = options.beam, options.max_len_a, options.max_len_b
        pending = [
            self.translator.translate_batch(
                [[self.pieces[i] for i in x] for x in batch],
                beam_size=beam,
                length_penalty=0.0,
                num_hypotheses=beam,
                max_decoding_length=max(max_lengths([len(x) for x in batch], a, b, self.ceiling)),
                max_input_length=0,
                return_scores=True,
                return_end_token=True,
                asynchronous=True,
            )
            for batch in batches
        ]
        for results in pending:
            yield [self.ranked(r.result(), options.alpha, options.nbest) for r in results]

    def ranked(self, result, alpha: float, nbest: int) -> list[Hypothesis]:
        hyps = []
        for tokens, score in zip(result.hypotheses, result.scores):
            ids = [self.ids[t] for t in tokens]
            # |Y| counts the EOS, as in nmt; a hypothesis cut at the limit has none.
            penalised = float(score) / length_penalty(len(ids), alpha)
            hyps.append(Hypothesis([i for i in ids if i != EOS], penalised))
        return sorted(hyps, key=lambda h: -h.score)[:nbest]


def device_of(ct2, name: str) -> tuple[str, int]:
    """--device as CTranslate2's (kind, index), GPUs counted by CTranslate2 itself."""
    kind, _, index = resolve_device_name(name, ct2.get_cuda_device_count() > 0).partition(":")
    return kind, int(index or 0)


def cpus() -> int:
    """The CPUs this process may run on (all of them where the OS cannot say, as on macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
