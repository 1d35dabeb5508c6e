"""transformers' names of nmt's tensors (the same in Marian and M2M100, without their `model.`
prefix) and the ids both sides agree on: the one place they are paired."""

from __future__ import annotations

from nmt_cli.config import ModelConfig

ABSENT = -100.0  # the output bias of a row outside the model's softmax: exp(-100) is nothing
SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")  # nmt's ids 0-3 (vocab.py)


def layer_names(c: ModelConfig) -> list[tuple[str, tuple[str, ...]]]:
    """Each of nmt's layer tensors (without .weight/.bias) with transformers' names of it, the
    same in Marian and M2M100 (without their `model.` prefix): the one place they are paired."""
    pairs: list[tuple[str, tuple[str, ...]]] = []

    def attention(mine: str, theirs: str) -> None:
        pairs.append((f"{mine}.q", (f"{theirs}.q_proj",)))
        pairs.append((f"{mine}.kv", (f"{theirs}.k_proj", f"{theirs}.v_proj")))
        pairs.append((f"{mine}.out", (f"{theirs}.out_proj",)))

    for side, layers in (("encoder", c.num_encoder_layers), ("decoder", c.num_decoder_layers)):
        for i in range(layers):
            p, m = f"{side}.{i}", f"{side}.layers.{i}"
            attention(f"{p}.self_attn", f"{m}.self_attn")
            pairs.append((f"{p}.res1.norm", (f"{m}.self_attn_layer_norm",)))
            if side == "decoder":
                attention(f"{p}.cross_attn", f"{m}.encoder_attn")
                pairs.append((f"{p}.res2.norm", (f"{m}.encoder_attn_layer_norm",)))
            pairs.append((f"{p}.ffn.inner", (f"{m}.fc1",)))
            pairs.append((f"{p}.ffn.outer", (f"{m}.fc2",)))
            pairs.append((f"{p}.res{3 if side == 'decoder' else 2}.norm", (f"{m}.final_layer_norm",)))
    return pairs
