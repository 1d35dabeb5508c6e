"""The model as CTranslate2 runs it: `nmt export --format ctranslate2` and `--engine ctranslate2`.

The weights go through `ctranslate2.specs.TransformerSpec` one for one: pre- or post-norm
layers, the self-attention's Q/K/V as one fused projection, the encoder-decoder attention's K/V
as one (as nmt computes them), embeddings scaled by sqrt(d_model), our sinusoid table, the tied
output projection, LayerNorm eps 1e-6. The source gets its EOS from CTranslate2
(add_source_eos) and the decoder starts from BOS, as nmt's own search does.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from nmt_cli.engine.beam import Hypothesis, length_penalty
from nmt_cli.errors import NmtError
from nmt_cli.package import CT2, SETTINGS, Model, settings, writing
from nmt_cli.rundir import atomic_write_json, sha256_file
from nmt_cli.shards import EOS

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


class Engine:
    """Beam search by CTranslate2 on batches of source ids, answering as nmt's search does."""

    def __init__(self, model: Model, device, compute_type: str, threads: int):
        ct2 = require()
        self._tmp = None
        where = model.ct2_dir
        if where is None:  # convert on the fly, in float32; compute_type quantises on load
            self._tmp = tempfile.TemporaryDirectory(prefix="nmt-ct2-")
            where = Path(self._tmp.name)
            save(model, where)
        try:
            self.translator = ct2.Translator(
                str(where),
                device=device.type,
                device_index=device.index or 0,
                compute_type=compute_type,
                inter_threads=1,
                intra_threads=threads,
            )
        except (RuntimeError, ValueError) as e:
            raise NmtError(
                f"CTranslate2 cannot load {model.where} on {device} as {compute_type}: {e}"
            ) from None
        self.pieces = pieces(model)
        self.ids = {p: i for i, p in enumerate(self.pieces)}

    def search(
        self, batch: list[list[int]], beam: int, alpha: float, max_lens: list[int], nbest: int
    ) -> list[list[Hypothesis]]:
        """nmt's beam search on `batch` (source ids without EOS), `max_lens` counting the EOS.

        CTranslate2 divides by |Y| ** alpha where nmt divides by GNMT's ((5 + |Y|) / 6) ** alpha.
        Its search ranks by the raw log-probability and applies the penalty only to finished
        hypotheses, so: ask for all `beam` of them unpenalised, and rank them as nmt does.
        One call has one length limit, the batch's largest (nmt's is each sentence's own; the
        batches hold sentences of close lengths, and a trained model rarely meets its limit).
        """
        results = self.translator.translate_batch(
            [[self.pieces[i] for i in x] for x in batch],
            beam_size=beam,
            length_penalty=0.0,
            num_hypotheses=beam,
            max_decoding_length=max(max_lens),
            max_input_length=0,
            return_scores=True,
            return_end_token=True,
        )
        out = []
        for r in results:
            hyps = []
            for tokens, score in zip(r.hypotheses, r.scores):
                ids = [self.ids[t] for t in tokens]
                # |Y| counts the EOS, as in nmt; a hypothesis cut at the limit has none.
                hyps.append(
                    Hypothesis([i for i in ids if i != EOS], float(score) / length_penalty(len(ids), alpha))
                )
            out.append(sorted(hyps, key=lambda h: -h.score)[:nbest])
        return out
