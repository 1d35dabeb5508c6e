"""`nmt import`: a MarianMTModel folder (OPUS-MT's ~1,500 models), or an M2M100 folder `nmt
export` wrote, read as nmt's model: its config, its weights under nmt's names and its
sentencepiece models with nmt's ids (pieces.py), exactly the function transformers computes."""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path

from nmt_cli.config import ModelConfig
from nmt_cli.config.model import MODEL_BOUNDS
from nmt_cli.errors import NmtError
from nmt_cli.files import (
    read_json,
    read_regular,
    sha256_file,
)
from nmt_cli.hf import m2m100
from nmt_cli.hf.imported import Marian
from nmt_cli.hf.pieces import Side, renumbered, require_protobuf
from nmt_cli.hf.weights import as_nmt, read_weights
from nmt_cli.inference.models import Model
from nmt_cli.vocab import BOS, MAX_SPM_BYTES, Vocabularies

# transformers' MarianConfig defaults: a config.json names only what differs from them
MARIAN_DEFAULTS = dict(
    vocab_size=58101,
    decoder_vocab_size=None,
    max_position_embeddings=1024,
    encoder_layers=12,
    encoder_ffn_dim=4096,
    encoder_attention_heads=16,
    decoder_layers=12,
    decoder_ffn_dim=4096,
    decoder_attention_heads=16,
    activation_function="gelu",
    d_model=1024,
    dropout=0.1,
    attention_dropout=0.0,
    activation_dropout=0.0,
    decoder_start_token_id=58100,
    scale_embedding=False,
    pad_token_id=58100,
    eos_token_id=0,
    share_encoder_decoder_embeddings=True,
    tie_word_embeddings=True,
)
# transformers' M2M100Config defaults; nmt reads the M2M100 folders its export writes
M2M100_DEFAULTS = dict(
    MARIAN_DEFAULTS,
    vocab_size=128112,
    activation_function="relu",
    attention_dropout=0.1,
    decoder_start_token_id=2,
    scale_embedding=True,
    pad_token_id=1,
    eos_token_id=2,
)
ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}


def _folder_config(folder: Path) -> dict:
    """config.json of a Marian, M2M100 or NLLB model, with
    transformers' defaults for what it leaves out."""
    path = folder / "config.json"
    if not path.is_file():
        raise NmtError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    raw = read_json(path, 1 << 20)
    kind = raw.get("model_type")
    if kind == "m2m_100":
        return {**M2M100_DEFAULTS, **raw}
    if kind != "marian":
        raise NmtError(
            f"{folder} holds a {kind or 'model of no model_type'!s:.40} model: `nmt import` reads "
            "MarianMTModel (OPUS-MT), M2M100 and NLLB folders"
        )
    return {**MARIAN_DEFAULTS, **raw}


def _settings(c: dict, folder: Path) -> tuple[int, str]:
    """The heads and activation of a Marian config, refused where nmt's model cannot be it."""
    where = f"{folder}/config.json"
    if c["encoder_attention_heads"] != c["decoder_attention_heads"]:
        raise NmtError(
            f"{where}: the encoder and decoder have different numbers of heads, which nmt's model cannot"
        )
    if c["encoder_ffn_dim"] != c["decoder_ffn_dim"]:
        raise NmtError(f"{where}: the encoder and decoder have different FFN sizes, which nmt's model cannot")
    activation = ACTIVATIONS.get(str(c["activation_function"]))
    if activation is None:
        raise NmtError(
            f"{where}: activation {c['activation_function']!r:.40} is not one nmt's model has "
            f"({', '.join(ACTIVATIONS)})"
        )
    for flag in ("normalize_before", "add_final_layer_norm", "normalize_embedding"):
        if c.get(flag):
            raise NmtError(f"{where}: {flag} is set; nmt reads transformers' Marian layers, which have none")
    if not c["tie_word_embeddings"]:
        raise NmtError(
            f"{where}: the output projection is not the decoder's embedding, which nmt's model ties"
        )
    return int(c["encoder_attention_heads"]), activation


def read_marian(folder: Path) -> Marian:
    """The MarianMTModel in `folder` (or an M2M100 model `nmt export` wrote) as nmt's model: its
    config, weights under nmt's names and sentencepiece models with nmt's ids, exactly the
    function transformers computes. The settings are checked before the weights are read."""
    require_protobuf()
    folder = Path(folder)
    c = _folder_config(folder)
    pre_norm = c["model_type"] == "m2m_100"
    heads, activation = _settings(c, folder)
    files: dict[str, str] = {}
    published = pre_norm and c["pad_token_id"] != -1  # an M2M100 or NLLB (an export's pad is -1)
    kind = "M2M100 or NLLB" if published else "Marian"

    def read(name: str, limit: int) -> bytes:
        path = folder / name
        if not path.is_file():
            raise NmtError(f"{folder} is not a complete {kind} model: it has no {name}")
        data = read_regular(path, limit)
        files[name] = hashlib.sha256(data).hexdigest()
        return data

    def vocabulary(name: str) -> dict[str, int]:
        if not (folder / name).is_file():
            raise NmtError(f"{folder} is not a complete {kind} model: it has no {name}")
        vocab = read_json(folder / name, 64 << 20)
        files[name] = sha256_file(folder / name)
        if not all(type(v) is int and v >= 0 for v in vocab.values()):
            raise NmtError(f"{folder}/{name} is not a vocabulary (a JSON object of piece: id)")
        if "<unk>" not in vocab:
            raise NmtError(f"{folder}/{name} has no <unk>")
        return vocab

    said = folder / "tokenizer_config.json"
    tokenizer = read_json(said, 1 << 20) if said.is_file() else {}
    eos, start = c["eos_token_id"], c["decoder_start_token_id"]
    if type(eos) is not int or type(start) is not int:
        raise NmtError(f"{folder}/config.json: eos_token_id and decoder_start_token_id must be ids")
    if published:
        size, pad = c["vocab_size"], c["pad_token_id"]
        most = MODEL_BOUNDS["vocab_size"][1]
        if type(size) is not int or not 0 < size <= most or type(pad) is not int or not 0 <= pad < size:
            raise NmtError(
                f"{folder}/config.json: vocab_size must be a number of rows up to {most:,} and "
                "pad_token_id one of them"
            )
        number = m2m100.numbering(
            folder, tokenizer, lambda path: files.update({path.name: sha256_file(path)})
        )
        spm = folder / "sentencepiece.bpe.model"
        side = m2m100.renumbered(read(spm.name, MAX_SPM_BYTES), spm, number, start, c["vocab_size"])
        config = _model_config(c, folder, heads, activation, len(side.rows), 0, c["pad_token_id"] + 1)
        weights = _weights(folder, config, side, side, False, True, files)
        return Marian(config, weights, side.model, side.model, files, tokenizer, number.languages)
    separate = bool(tokenizer.get("separate_vocabs")) or not c["share_encoder_decoder_embeddings"]
    source_vocab = vocabulary("vocab.json")
    target_vocab = vocabulary("target_vocab.json") if separate else source_vocab

    def pad_row(vocab: dict[str, int]) -> int:
        """PAD's own row where it has one: Marian's <pad> is its decoder's start (BOS here),
        and PAD a zero row; an nmt export's <pad> is PAD."""
        row = vocab.get("<pad>", -1)
        return -1 if row == start else row

    # the Marian rows of nmt's PAD, UNK, BOS and EOS (-1: a zero row)
    source = renumbered(
        read("source.spm", MAX_SPM_BYTES),
        folder / "source.spm",
        source_vocab,
        [pad_row(source_vocab), source_vocab["<unk>"], -1, eos],
        False,
    )
    target = renumbered(
        read("target.spm", MAX_SPM_BYTES),
        folder / "target.spm",
        target_vocab,
        [pad_row(target_vocab), target_vocab["<unk>"], start, eos],
        True,
    )
    # one vocabulary for both sides (an export of a joint model): one sentencepiece model (the
    # source has no BOS row: it never reads BOS)
    joint = not separate and source.model == target.model and source.rows[BOS + 1 :] == target.rows[BOS + 1 :]
    config = _model_config(
        c, folder, heads, activation, len(target.rows), 0 if joint else len(source.rows), 0
    )
    weights = _weights(folder, config, source, target, separate, joint, files)
    return Marian(config, weights, source.model, target.model, files, tokenizer)


def _model_config(
    c: dict, folder: Path, heads: int, activation: str, vocab: int, src_vocab: int, offset: int
) -> ModelConfig:
    """nmt's ModelConfig of the folder's config `c`: Marian's post-norm, or M2M100's pre-norm
    (its positions from `offset`)."""
    pre_norm = c["model_type"] == "m2m_100"
    try:
        return ModelConfig(
            vocab_size=vocab,
            src_vocab_size=src_vocab,
            num_encoder_layers=c["encoder_layers"],
            num_decoder_layers=c["decoder_layers"],
            d_model=c["d_model"],
            ffn=c["encoder_ffn_dim"],
            heads=heads,
            dropout=float(c["dropout"]),
            attention_dropout=float(c["attention_dropout"]),
            relu_dropout=float(c["activation_dropout"]),
            post_norm=not pre_norm,
            max_positions=c["max_position_embeddings"],
            activation=activation,
            # transformers' is 1e-5; an nmt export says its model's own (transformers ignores it)
            norm_eps=float(c.get("layer_norm_eps", 1e-5)),
            positions="tensor2tensor" if pre_norm else "marian",
            # Marian's final_logits_bias; a published M2M100's rows outside its softmax
            output_bias=not pre_norm or bool(offset),
            scale_embedding=bool(c["scale_embedding"]),
            position_offset=offset,
        )
    except (NmtError, TypeError, ValueError) as e:
        raise NmtError(f"{folder}/config.json: {e}") from None


def _weights(
    folder: Path, config: ModelConfig, source: Side, target: Side, separate: bool, joint: bool, files: dict
) -> dict:
    """The folder's weights under nmt's names, checked against `config`."""
    w, weights_path = read_weights(folder, config)
    files[weights_path.name] = sha256_file(weights_path)
    try:
        weights = as_nmt(config, w, source, target, separate)
        if joint:
            del weights["src_embed.weight"]
    except (KeyError, IndexError, RuntimeError) as e:
        raise NmtError(
            f"{weights_path} does not hold the model config.json declares ({type(e).__name__}: {e})"
        ) from None
    except NmtError as e:
        raise NmtError(f"{weights_path}: {e}") from None
    from nmt_cli.inference.checks import same_shapes

    held = {k: tuple(v.shape) for k, v in weights.items()}
    same_shapes(config, held, folder / "config.json", weights_path.name)
    return weights


def languages(folder: Path, said: dict, src: str | None, tgt: str | None) -> tuple[str, str]:
    """The pair a Marian folder translates: given, else its tokenizer_config's (`said`), else
    its name's (opus-mt-en-de)."""
    named = re.search(r"([a-z]{2,3})-([a-z]{2,3})$", Path(folder).resolve().name)
    src = src or said.get("source_lang") or (named.group(1) if named else None)
    tgt = tgt or said.get("target_lang") or (named.group(2) if named else None)
    if not (isinstance(src, str) and isinstance(tgt, str) and src and tgt):
        raise NmtError(f"{folder} does not say which languages it translates: give --src and --tgt")
    return src, tgt


def _multilingual(folder: Path, marian: Marian, src: str | None, tgt: str | None) -> tuple[str, str]:
    """The languages an M2M100 or NLLB import translates unless told (--src-lang and
    --tgt-lang choose others): given, else its tokenizer_config's."""
    src = src or marian.tokenizer.get("src_lang")
    tgt = tgt or marian.tokenizer.get("tgt_lang")
    for code, flag in ((src, "--src"), (tgt, "--tgt")):
        if not isinstance(code, str) or code not in marian.languages:
            some = ", ".join(list(marian.languages)[:6])
            raise NmtError(
                f"{folder} is multilingual: give {flag}, one of its {len(marian.languages)} languages "
                f"({some}, …), for it to translate unless told otherwise"
            )
    assert isinstance(src, str) and isinstance(tgt, str)
    return src, tgt


def import_marian(
    folder: Path,
    out: Path,
    src: str | None = None,
    tgt: str | None = None,
    trim: list[Path] | None = None,
    kept: list[str] | None = None,
) -> Model:
    """Write the Marian, M2M100 or NLLB model of `folder` as an nmt package in `out`, its
    vocabulary cut to the pieces of the texts `trim` and the languages `kept` (default: src
    and tgt) where given (hf/trim.py); returns it."""
    from nmt_cli.inference import models
    from nmt_cli.inference import packages as export

    folder = Path(folder)
    if not folder.is_dir():
        raise NmtError(f"{folder} not found: give the folder of a downloaded Hugging Face model")
    marian = read_marian(folder)
    if marian.languages:
        src, tgt = _multilingual(folder, marian, src, tgt)
    else:
        src, tgt = languages(folder, marian.tokenizer, src, tgt)
    if trim:
        from nmt_cli.hf.trim import trimmed
        from nmt_cli.textio import read_lines

        wanted = list(dict.fromkeys([src, tgt, *(kept or [])]))
        for path in trim:
            if not Path(path).is_file():
                raise NmtError(f"--trim {path} not found")
        lines = (line for path in trim for line in read_lines(Path(path)))
        marian = trimmed(marian, lines, wanted, str(folder))
    with tempfile.TemporaryDirectory() as tmp:
        vocabs = Vocabularies.in_folder(Path(tmp), joint=not marian.config.src_vocab_size)
        vocabs.source.write_bytes(marian.source)
        vocabs.target.write_bytes(marian.target)  # the same file, for a joint model
        model = Model(
            where=folder,
            config=marian.config,
            vocabs=vocabs,
            src=src,
            tgt=tgt,
            sha256="",
            load_weights=lambda: marian.weights,
            provenance={
                "imported": {
                    "from": str(folder.resolve()),
                    "format": "marian" if not marian.languages else "m2m100",
                    "files": marian.files,
                    **({"languages": marian.languages} if marian.languages else {}),
                }
            },
        )
        export.export_nmt(model, out)
    return models.from_dir(out)
