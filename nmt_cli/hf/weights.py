"""A Hugging Face folder's weights, read as data (safetensors, or a weights-only pickle within
the bytes its config allows), and put under nmt's names with the embeddings gathered by id."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nmt_cli.config import ModelConfig
from nmt_cli.errors import NmtError
from nmt_cli.files import check_regular, check_torch_zip
from nmt_cli.hf.names import ABSENT, SPECIALS, layer_names
from nmt_cli.hf.pieces import Side

MAX_WEIGHTS_BYTES = 64 << 30


def read_weights(folder: Path, config: ModelConfig) -> tuple[dict, Path]:
    import torch

    from nmt_cli.engine.checkpoint import most_bytes

    safetensors, pickle = folder / "model.safetensors", folder / "pytorch_model.bin"
    if safetensors.is_file():
        from safetensors.torch import load_file

        check_regular(safetensors, MAX_WEIGHTS_BYTES)
        try:
            tensors, path = load_file(str(safetensors)), safetensors
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types
            raise NmtError(f"{safetensors} is not a safetensors file ({type(e).__name__}: {e})") from None
    elif pickle.is_file():
        check_regular(pickle, MAX_WEIGHTS_BYTES)
        with open(pickle, "rb") as f:  # checked above: a regular file, not a link
            # Marian's tables may be held up to four times (shared, both embeddings, lm_head)
            check_torch_zip(f, pickle, most_bytes(dataclasses.asdict(config)))
            try:
                tensors, path = torch.load(f, map_location="cpu", weights_only=True), pickle
            except Exception as e:  # noqa: BLE001 - an unpickling error of any kind
                raise NmtError(f"{pickle} is not a weights-only PyTorch file ({type(e).__name__})") from None
    else:
        raise NmtError(f"{folder} has no weights: model.safetensors or pytorch_model.bin")
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise NmtError(f"{path} holds no dictionary of tensors")
    return {k.removeprefix("model."): v.float() for k, v in tensors.items()}, path


def as_nmt(c: ModelConfig, w: dict, source: Side, target: Side, separate: bool) -> dict:
    """Marian's weights `w` under nmt's names, the embeddings and output bias gathered by id."""
    import torch

    shared = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")
    if separate:
        src_table = w.get("encoder.embed_tokens.weight", w.get("shared.weight"))
        tgt_table = w.get("decoder.embed_tokens.weight", w.get("lm_head.weight"))
    else:
        src_table = next((w[k] for k in shared if k in w), None)
        tgt_table = src_table
    if src_table is None or tgt_table is None:
        raise KeyError("no embedding")
    if "lm_head.weight" in w and not torch.equal(w["lm_head.weight"], tgt_table):
        raise NmtError(
            "the output projection (lm_head) is not the decoder's embedding; nmt's model ties them"
        )

    def gathered(table: torch.Tensor, side: Side) -> torch.Tensor:
        # what the gather makes is the vocabulary's rows x the table's width: both checked
        # against the config and the table first (a large vocab.json over a small table, or a
        # wide table, would be gathered into gigabytes before any shape check)
        if table.dim() != 2 or table.shape[1] != c.d_model:
            raise NmtError(f"an embedding table is {tuple(table.shape)}, not (rows, {c.d_model}) as declared")
        if len(side.rows) > 2 * table.shape[0] + len(SPECIALS) or max(side.rows) >= table.shape[0]:
            raise NmtError(
                f"the vocabulary names {len(side.rows)} pieces up to row {max(side.rows)} of an "
                f"embedding table of {table.shape[0]} rows"
            )
        rows = torch.tensor(side.rows)
        out = table[rows.clamp(min=0)].clone()
        out[rows < 0] = 0.0
        return out

    out = {"embed.weight": gathered(tgt_table, target), "src_embed.weight": gathered(src_table, source)}
    if c.output_bias:
        bias = w.get("final_logits_bias", torch.zeros(1, tgt_table.shape[0])).reshape(-1)
        out["output_bias"] = bias[torch.tensor(target.rows).clamp(min=0)].clone()
        out["output_bias"][torch.tensor(target.absent)] = ABSENT
    if not c.post_norm:  # M2M100: the final LayerNorms
        for side in ("encoder", "decoder"):
            out[f"{side}_norm.weight"] = w[f"{side}.layer_norm.weight"]
            out[f"{side}_norm.bias"] = w[f"{side}.layer_norm.bias"]

    for mine, theirs in layer_names(c):  # K and V side by side in nmt's one projection
        for part in ("weight", "bias"):
            out[f"{mine}.{part}"] = torch.cat([w[f"{name}.{part}"] for name in theirs])
    return out
