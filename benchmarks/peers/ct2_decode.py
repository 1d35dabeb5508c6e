"""CTranslate2 beam search (beam 4) on random weights of the given shape, built through
ctranslate2.specs, every sentence forced to exactly --length tokens. Runs in the ct2 venv."""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import SHAPES  # noqa: E402


def spec_for(shape: dict):
    from ctranslate2.specs import transformer_spec

    spec = transformer_spec.TransformerSpec.from_config(shape["layers"], shape["heads"], pre_norm=True)
    rng = np.random.default_rng(0)
    d, f, v = shape["d"], shape["ffn"], shape["vocab"]

    def w(*dims):
        return (rng.standard_normal(dims) * 0.02).astype(np.float32)

    def linear(s, out_dim, in_dim):
        s.weight, s.bias = w(out_dim, in_dim), np.zeros(out_dim, np.float32)

    def norm(s):
        s.gamma, s.beta = np.ones(d, np.float32), np.zeros(d, np.float32)

    embeddings = w(v, d)
    positions = w(1024, d)
    for side in (spec.encoder, spec.decoder):
        emb = side.embeddings[0] if isinstance(side.embeddings, list) else side.embeddings
        emb.weight = embeddings
        side.scale_embeddings = True
        side.position_encodings.encodings = positions
        norm(side.layer_norm)
        for layer in side.layer:
            linear(layer.self_attention.linear[0], 3 * d, d)
            linear(layer.self_attention.linear[1], d, d)
            norm(layer.self_attention.layer_norm)
            if hasattr(layer, "attention"):
                linear(layer.attention.linear[0], d, d)
                linear(layer.attention.linear[1], 2 * d, d)
                linear(layer.attention.linear[2], d, d)
                norm(layer.attention.layer_norm)
            linear(layer.ffn.linear_0, f, d)
            linear(layer.ffn.linear_1, d, f)
            norm(layer.ffn.layer_norm)
    spec.decoder.projection.weight = embeddings
    spec.decoder.projection.bias = np.zeros(v, np.float32)
    vocab = ["<blank>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(v - 4)]
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    spec.config.add_source_eos = True
    return spec, vocab


def main():
    import ctranslate2

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--compute-type", default="float32")
    a = ap.parse_args()
    shape = SHAPES[a.shape]
    spec, vocab = spec_for(shape)
    with tempfile.TemporaryDirectory() as folder:
        spec.validate()
        spec.optimize(quantization=a.compute_type if a.compute_type != "float32" else None)
        spec.save(folder)
        # CTranslate2 at its fastest on a 2-core CPU: two workers of one thread, each decoding
        # its own batch (one batch on two threads was up to 5x slower in int8; deploy.py).
        translator = ctranslate2.Translator(
            folder, device="cpu", compute_type=a.compute_type, inter_threads=2, intra_threads=1
        )
        sources = json.loads(Path(a.ids).read_text())
        warm = [[vocab[x % (shape["vocab"] - 4) + 4] for x in s] for s in sources[:2]]
        translator.translate_batch(warm, beam_size=4, max_decoding_length=4)  # untimed
        start = time.perf_counter()
        pending = [
            translator.translate_batch(
                [[vocab[x % (shape["vocab"] - 4) + 4] for x in s] for s in sources[i : i + a.batch]],
                beam_size=4,
                max_batch_size=a.batch,
                max_decoding_length=a.length,
                min_decoding_length=a.length,
                asynchronous=True,
            )
            for i in range(0, len(sources), a.batch)
        ]
        tokens = sum(len(r.result().hypotheses[0]) for batch in pending for r in batch)
        seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "system": f"CTranslate2 {ctranslate2.__version__} {a.compute_type}",
                "seconds": seconds,
                "tokens": tokens,
                "sentences": len(sources),
            }
        )
    )


if __name__ == "__main__":
    main()
