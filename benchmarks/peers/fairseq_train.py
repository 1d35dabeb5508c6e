"""fairseq 0.12.2's transformer, one training step (forward, label-smoothed loss, backward,
Adam), on the batch of benchmarks/common.py. Runs in the fairseq venv; prints JSON lines."""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import SHAPES, batch, time_steps  # noqa: E402


def build(shape: dict):
    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerModel
    from fairseq.models.transformer.transformer_legacy import base_architecture

    d = Dictionary()
    for i in range(shape["vocab"] - len(d)):
        d.add_symbol(f"w{i}")
    args = argparse.Namespace(
        encoder_layers=shape["layers"],
        decoder_layers=shape["layers"],
        encoder_embed_dim=shape["d"],
        decoder_embed_dim=shape["d"],
        encoder_ffn_embed_dim=shape["ffn"],
        decoder_ffn_embed_dim=shape["ffn"],
        encoder_attention_heads=shape["heads"],
        decoder_attention_heads=shape["heads"],
        share_all_embeddings=True,
        encoder_normalize_before=True,
        decoder_normalize_before=True,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        max_source_positions=1024,
        max_target_positions=1024,
    )
    base_architecture(args)
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    return TransformerModel.build_model(args, task)


def main():
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    shape = SHAPES[a.shape]
    model = build(shape).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    src, tgt_in, tgt_out = batch(shape["vocab"])
    lengths = torch.full((len(src),), src.shape[1])

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            net_output = model(src, lengths, tgt_in)
        lprobs = model.get_normalized_probs(net_output, log_probs=True).float()
        loss, _ = label_smoothed_nll_loss(
            lprobs.view(-1, lprobs.size(-1)), tgt_out.view(-1), 0.1, ignore_index=1, reduce=True
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = time_steps(step, 2, a.repeats)
    print(
        json.dumps(
            {
                "system": "fairseq 0.12.2",
                "shape": a.shape,
                "precision": a.precision,
                "seconds": seconds,
                "tgt_tokens_per_s": tgt_out.numel() / seconds,
            }
        )
    )


if __name__ == "__main__":
    main()
