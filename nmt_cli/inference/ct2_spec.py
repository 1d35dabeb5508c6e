"""nmt's model as CTranslate2's: the weights go through `ctranslate2.specs.TransformerSpec` one
for one: pre- or post-norm layers, the self-attention's Q/K/V as one fused projection, the
encoder-decoder attention's K/V as one (as nmt computes them), embeddings scaled by
sqrt(d_model) (or not), the model's sinusoid table, activation and LayerNorm eps, the tied
output projection and its bias, the source's own embedding and vocabulary where they are
separate. The source gets its EOS from CTranslate2
(add_source_eos) and the decoder starts from BOS, as nmt's own search does. `nmt export` writes
the result; backend_ct2.py converts a model on the fly."""

from __future__ import annotations

from pathlib import Path

from nmt_cli import floors
from nmt_cli.inference.models import Model
from nmt_cli.vocab import pieces


def require_ctranslate2():
    return floors.require("ctranslate2", "CTranslate2", floors.CTRANSLATE2, "ct2")


def save(model: Model, folder: Path, quantization: str = "float32") -> None:
    """`model` as CTranslate2's model files in `folder`, with its shortlist (as vmap.txt)."""
    from nmt_cli.inference import shortlist  # numpy, as build_spec: a conversion's, not a start's

    spec = build_spec(model)
    if model.shortlist is not None:  # CTranslate2 copies the file it is given: a parsed copy
        parsed = folder / f".{shortlist.NAME}"
        shortlist.copy(model, parsed)
        spec.register_vocabulary_mapping(str(parsed))
    spec.validate()
    spec.optimize(quantization=None if quantization == "float32" else quantization)
    spec.save(str(folder))
    if model.shortlist is not None:
        parsed.unlink()


def build_spec(model: Model):
    """A TransformerSpec holding `model`'s weights (float32), with its vocabulary."""
    import numpy as np

    ct2 = require_ctranslate2()
    from nmt_cli.engine.model import sinusoids

    c, w = model.config, {k: v.float().numpy() for k, v in model.weights().items()}
    act = ct2.specs.Activation
    spec = ct2.specs.TransformerSpec.from_config(
        (c.num_encoder_layers, c.num_decoder_layers),
        c.heads,
        pre_norm=not c.post_norm,
        activation={"relu": act.RELU, "swish": act.SWISH, "gelu": act.GELU}[c.activation],
        alignment_heads=c.heads,  # its attention for --alignments: all heads, as nmt's engine takes
    )
    spec.config.layer_norm_epsilon = c.norm_eps
    spec.config.add_source_eos = True
    table = sinusoids(c.max_positions, c.d_model, c.positions, c.position_offset).numpy()

    def norm(dst, name: str) -> None:
        dst.gamma, dst.beta = w[f"{name}.weight"], w[f"{name}.bias"]

    def linear(dst, *names: str) -> None:  # several names: fused along the output rows
        dst.weight = np.concatenate([w[f"{n}.weight"] for n in names])
        dst.bias = np.concatenate([w[f"{n}.bias"] for n in names])

    for side, layers in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        embeddings = layers.embeddings[0] if side == "encoder" else layers.embeddings
        own = side == "encoder" and c.src_vocab_size  # the source's own embedding
        embeddings.weight = w["src_embed.weight" if own else "embed.weight"]
        layers.scale_embeddings = c.scale_embedding
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
    spec.decoder.projection.bias = w.get("output_bias", np.zeros(c.vocab_size, dtype=np.float32))
    spec.register_source_vocabulary(pieces(model.vocabs.source))
    spec.register_target_vocabulary(pieces(model.vocabs.target))
    return spec
