"""Models in the Hugging Face format, in and out: a `MarianMTModel` folder (OPUS-MT's ~1,500
models) read as an nmt model (`nmt import`), and an nmt model written as a folder that
`transformers` loads (`nmt export --format huggingface`). Neither needs `transformers`: the folder
is JSON, safetensors (or a weights-only pickle) and sentencepiece models.

The ids. A Marian folder has two sentencepiece models that only cut text into pieces, and a
vocabulary (`vocab.json`, the source's and the target's when they are separate) that numbers the
pieces: EOS 0, UNK 1, PAD last, and PAD is also what the decoder starts from. nmt numbers pieces
by its sentencepiece models, PAD 0, UNK 1, BOS 2, EOS 3 (vocab.py). So the import writes each
side's sentencepiece model again with nmt's specials first and every other piece after them, in
their order and with their scores (the pieces a text is cut into stay the same), and gathers the
embedding rows and output biases by piece:

- a source piece the vocabulary lacks is UNK's row, as Marian's tokenizer makes it UNK;
- the target's model also holds every piece of the vocabulary that its sentencepiece model lacks,
  as an unused piece (never cut from text), so that the output scores cover Marian's whole
  vocabulary and the log-probabilities are Marian's;
- a target piece the vocabulary lacks is unused too, and its output bias is ABSENT (it is not in
  Marian's softmax), as is PAD's;
- BOS is Marian's PAD row (the decoder's start); the search never emits it, as `generate` never
  emits PAD.

The export is the other way, with nmt's own ids written into `vocab.json`. transformers' Marian
is post-norm with Marian's sinusoids; a pre-norm model with tensor2tensor's sinusoids is M2M100,
whose positions start after its padding id: PAD -1 there starts them at 0, as nmt's do.
LayerNorm's epsilon is 1e-5 in both architectures (nmt's own models: 1e-6; the export records the
model's own, which the import reads back). Of M2M100 folders the import reads only those.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nmt_cli.config import ModelConfig
from nmt_cli.errors import NmtError
from nmt_cli.files import (
    atomic_write_json,
    check_regular,
    check_torch_zip,
    copy_regular,
    new_file_mode,
    read_json,
    read_regular,
    sha256_file,
)
from nmt_cli.models import Model
from nmt_cli.vocab import BOS, EOS, MAX_SPM_BYTES, PAD, UNK, Vocabularies, pieces

ABSENT = -100.0  # the output bias of a row outside the model's softmax: exp(-100) is nothing
MAX_WEIGHTS_BYTES = 64 << 30
SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")  # nmt's ids 0-3 (vocab.py)
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


def _spm_proto(data: bytes, where: Path):
    from sentencepiece import sentencepiece_model_pb2 as pb  # needs protobuf: '.[huggingface]'

    proto = pb.ModelProto()  # type: ignore[attr-defined]  # generated at import
    try:
        proto.ParseFromString(data)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError
        raise NmtError(f"{where} is not a sentencepiece model ({type(e).__name__})") from None
    if not proto.pieces:
        raise NmtError(f"{where} is not a sentencepiece model (it has no pieces)")
    return proto


def require_protobuf() -> None:
    try:
        from sentencepiece import sentencepiece_model_pb2  # noqa: F401
    except ImportError:
        raise NmtError(
            "the Hugging Face format needs protobuf: pip install 'nmt-cli[huggingface]' "
            "(or pip install protobuf)"
        ) from None


@dataclass
class Side:
    """One side's sentencepiece model rewritten with nmt's ids, and for each of its ids the
    Marian row it takes (-1: none, a zero row) and whether it is outside the softmax."""

    model: bytes
    rows: list[int]
    absent: list[bool]


def renumbered(spm: bytes, where: Path, vocab: dict[str, int], special_rows: list[int], target: bool) -> Side:
    """`spm` with nmt's specials at 0-3 (their Marian rows `special_rows`) and its other pieces
    after them; the target's also with the pieces of `vocab` it lacks, unused."""
    proto = _spm_proto(spm, where)
    t = type(proto.pieces[0])
    normal, unknown, control, user, unused = t.NORMAL, t.UNKNOWN, t.CONTROL, t.USER_DEFINED, t.UNUSED
    own = [p for p in proto.pieces if p.type in (normal, user, unused, t.BYTE) and p.piece not in SPECIALS]
    listed = {p.piece for p in own}
    rows, absent = list(special_rows), [r < 0 for r in special_rows]
    absent[UNK] = False
    pieces = [(s, 0.0, kind) for s, kind in zip(SPECIALS, (control, unknown, control, control))]
    for p in own:
        row = vocab.get(p.piece)
        kind = p.type
        if target and row is None and kind in (normal, user):
            kind = unused  # Marian cannot emit it: never cut from target text either
        pieces.append((p.piece, p.score, kind))
        rows.append(special_rows[UNK] if row is None else row)
        absent.append(row is None and target)
    # A language tag (`>>deu<<`) is a piece of the vocabulary the tokenizer takes whole from the
    # start of the source; a user-defined piece is taken whole wherever it is. With the word
    # boundary sentencepiece puts before the line's first word: one piece, as Marian's.
    for piece, row in vocab.items():
        tag = re.fullmatch(r">>[^<>\s]+<<", piece) is not None
        if piece in listed or piece in SPECIALS or (tag and "\u2581" + piece in listed):
            continue  # (an export's vocab.json lists a tag both ways)
        if target:
            pieces.append((piece, 0.0, unused))
        elif tag:
            pieces.append(("\u2581" + piece, 0.0, user))
        else:
            continue
        rows.append(row)
        absent.append(False)
    ts = proto.trainer_spec
    if [(p.piece, p.score, p.type) for p in proto.pieces] == pieces and (
        ts.pad_id,
        ts.unk_id,
        ts.bos_id,
        ts.eos_id,
    ) == (PAD, UNK, BOS, EOS):
        return Side(spm, rows, absent)  # nmt's own (an export's): the same file
    del proto.pieces[:]
    for piece, score, kind in pieces:
        proto.pieces.add(piece=piece, score=score, type=kind)
    ts.pad_id, ts.unk_id, ts.bos_id, ts.eos_id = PAD, UNK, BOS, EOS
    ts.pad_piece, ts.unk_piece, ts.bos_piece, ts.eos_piece = SPECIALS
    ts.vocab_size = len(pieces)
    return Side(proto.SerializeToString(), rows, absent)


@dataclass
class Marian:
    """What `nmt import` read from a MarianMTModel folder."""

    config: ModelConfig
    weights: dict  # nmt's names
    source: bytes  # the sentencepiece models, with nmt's ids
    target: bytes
    files: dict[str, str]  # the folder's files read, with their sha256
    tokenizer: dict  # its tokenizer_config.json (empty where it has none)


def _folder_config(folder: Path) -> dict:
    """config.json of a Marian model, or of an M2M100 one that `nmt export` wrote, with
    transformers' defaults for what it leaves out."""
    path = folder / "config.json"
    if not path.is_file():
        raise NmtError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    raw = read_json(path, 1 << 20)
    kind = raw.get("model_type")
    if kind == "m2m_100" and raw.get("pad_token_id") == -1:
        return {**M2M100_DEFAULTS, **raw}
    if kind == "m2m_100":  # its positions start at its padding id + 1: not nmt's at 0
        raise NmtError(
            f"{folder} holds an M2M100 model: `nmt import` reads MarianMTModel folders (OPUS-MT), "
            "and the M2M100 folders `nmt export` writes"
        )
    if kind != "marian":
        raise NmtError(
            f"{folder} holds a {kind or 'model of no model_type'!s:.40} model: `nmt import` reads "
            "MarianMTModel folders (OPUS-MT)"
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


def _weights(folder: Path, config: ModelConfig) -> tuple[dict, Path]:
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

    def read(name: str, limit: int) -> bytes:
        path = folder / name
        if not path.is_file():
            raise NmtError(f"{folder} is not a complete Marian model: it has no {name}")
        data = read_regular(path, limit)
        files[name] = hashlib.sha256(data).hexdigest()
        return data

    def vocabulary(name: str) -> dict[str, int]:
        if not (folder / name).is_file():
            raise NmtError(f"{folder} is not a complete Marian model: it has no {name}")
        vocab = read_json(folder / name, 64 << 20)
        files[name] = sha256_file(folder / name)
        if not all(type(v) is int and v >= 0 for v in vocab.values()):
            raise NmtError(f"{folder}/{name} is not a vocabulary (a JSON object of piece: id)")
        if "<unk>" not in vocab:
            raise NmtError(f"{folder}/{name} has no <unk>")
        return vocab

    said = folder / "tokenizer_config.json"
    tokenizer = read_json(said, 1 << 20) if said.is_file() else {}
    separate = bool(tokenizer.get("separate_vocabs")) or not c["share_encoder_decoder_embeddings"]
    source_vocab = vocabulary("vocab.json")
    target_vocab = vocabulary("target_vocab.json") if separate else source_vocab
    eos, start = c["eos_token_id"], c["decoder_start_token_id"]
    if type(eos) is not int or type(start) is not int:
        raise NmtError(f"{folder}/config.json: eos_token_id and decoder_start_token_id must be ids")

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
    try:
        config = ModelConfig(
            vocab_size=len(target.rows),
            src_vocab_size=0 if joint else len(source.rows),
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
            output_bias=not pre_norm,
            scale_embedding=bool(c["scale_embedding"]),
        )
    except (NmtError, TypeError, ValueError) as e:
        raise NmtError(f"{folder}/config.json: {e}") from None
    w, weights_path = _weights(folder, config)
    files[weights_path.name] = sha256_file(weights_path)
    try:
        weights = _as_nmt(config, w, source, target, separate)
        if joint:
            del weights["src_embed.weight"]
    except (KeyError, IndexError, RuntimeError) as e:
        raise NmtError(
            f"{weights_path} does not hold the model config.json declares ({type(e).__name__}: {e})"
        ) from None
    except NmtError as e:
        raise NmtError(f"{weights_path}: {e}") from None
    from nmt_cli.models import same_shapes

    held = {k: tuple(v.shape) for k, v in weights.items()}
    same_shapes(config, held, folder / "config.json", weights_path.name)
    return Marian(config, weights, source.model, target.model, files, tokenizer)


def _as_nmt(c: ModelConfig, w: dict, source: Side, target: Side, separate: bool) -> dict:
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


def languages(folder: Path, said: dict, src: str | None, tgt: str | None) -> tuple[str, str]:
    """The pair a Marian folder translates: given, else its tokenizer_config's (`said`), else
    its name's (opus-mt-en-de)."""
    named = re.search(r"([a-z]{2,3})-([a-z]{2,3})$", Path(folder).resolve().name)
    src = src or said.get("source_lang") or (named.group(1) if named else None)
    tgt = tgt or said.get("target_lang") or (named.group(2) if named else None)
    if not (isinstance(src, str) and isinstance(tgt, str) and src and tgt):
        raise NmtError(f"{folder} does not say which languages it translates: give --src and --tgt")
    return src, tgt


def import_marian(folder: Path, out: Path, src: str | None = None, tgt: str | None = None) -> Model:
    """Write the MarianMTModel of `folder` (or an M2M100 model `nmt export` wrote) as an nmt
    package in `out`; returns it."""
    from nmt_cli import export, models

    folder = Path(folder)
    if not folder.is_dir():
        raise NmtError(f"{folder} not found: give the folder of a downloaded Hugging Face model")
    marian = read_marian(folder)
    src, tgt = languages(folder, marian.tokenizer, src, tgt)
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
                "imported": {"from": str(folder.resolve()), "format": "marian", "files": marian.files}
            },
        )
        export.export_nmt(model, out)
    return models.from_dir(out)


# -- out


def export_huggingface(model: Model, out: Path) -> None:
    """Write `model` as a folder transformers loads (AutoModelForSeq2SeqLM, AutoTokenizer)."""
    from nmt_cli import export

    c = model.config
    if model.load_weights is None:
        raise NmtError(
            f"{model.where} is a CTranslate2 export: export from the run directory or an nmt package"
        )
    if c.post_norm and c.positions != "marian":
        raise NmtError(
            "no Hugging Face architecture computes a post-norm model with tensor2tensor's sinusoids "
            "(transformers' Marian has its own): export a pre-norm model, or a model `nmt import` made"
        )
    if not c.post_norm and (c.positions != "tensor2tensor" or c.output_bias):
        raise NmtError(
            "no Hugging Face architecture computes a pre-norm model with Marian's sinusoids or an "
            "output bias (M2M100 has neither)"
        )
    if not c.post_norm and c.src_vocab_size:
        raise NmtError(
            "M2M100, the Hugging Face architecture of pre-norm models, has one vocabulary for both "
            "sides: this model's are separate"
        )
    weights = {k: v.float().contiguous() for k, v in model.weights().items()}
    with export.staged(out) as staging:
        write_tokenizer(model, staging)
        if c.post_norm:
            config, tensors = _as_marian(c, weights)
        else:
            config, tensors = _as_m2m100(c, weights)
        from safetensors.torch import save_file

        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(staging / "model.safetensors", new_file_mode())  # safetensors writes it 0600
        atomic_write_json(staging / "config.json", config)
        atomic_write_json(staging / "generation_config.json", _generation(config))
        atomic_write_json(
            staging / "nmt_provenance.json", {"exported_from": str(model.where), **model.provenance}
        )


def write_tokenizer(model: Model, folder: Path) -> None:
    """MarianTokenizer's files with nmt's ids: the sentencepiece models cut the text, vocab.json
    (and target_vocab.json) number the pieces as nmt's model does."""
    vocabs = model.vocabs
    copy_regular(vocabs.source, folder / "source.spm", MAX_SPM_BYTES, follow=False)
    copy_regular(vocabs.target, folder / "target.spm", MAX_SPM_BYTES, follow=False)
    source = {p: i for i, p in enumerate(pieces(vocabs.source))}
    # a language tag `nmt import` made one piece with its word boundary: MarianTokenizer looks
    # it up bare, as it takes it from the start of a line
    source.update({p[1:]: i for p, i in source.items() if re.fullmatch(r"\u2581>>[^<>\s]+<<", p)})
    atomic_write_json(folder / "vocab.json", source)
    if not vocabs.joint:
        atomic_write_json(folder / "target_vocab.json", {p: i for i, p in enumerate(pieces(vocabs.target))})
    atomic_write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "MarianTokenizer",
            "source_lang": model.src,
            "target_lang": model.tgt,
            "separate_vocabs": not vocabs.joint,
            "unk_token": "<unk>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "model_max_length": model.config.max_positions - 1,
        },
    )


def _common(c: ModelConfig) -> dict:
    return {
        "d_model": c.d_model,
        "encoder_layers": c.num_encoder_layers,
        "decoder_layers": c.num_decoder_layers,
        "encoder_attention_heads": c.heads,
        "decoder_attention_heads": c.heads,
        "encoder_ffn_dim": c.ffn,
        "decoder_ffn_dim": c.ffn,
        "activation_function": c.activation,
        "dropout": c.dropout,
        "attention_dropout": c.attention_dropout,
        "activation_dropout": c.relu_dropout,
        "scale_embedding": c.scale_embedding,
        "max_position_embeddings": c.max_positions,
        "eos_token_id": EOS,
        "decoder_start_token_id": BOS,
        "forced_eos_token_id": EOS,  # nmt's search ends a translation at its limit with EOS
        # the model's own: transformers' Marian and M2M100 compute with 1e-5 and ignore this;
        # `nmt import` reads it back
        "layer_norm_eps": c.norm_eps,
        "is_encoder_decoder": True,
        "tie_word_embeddings": True,
    }


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


def _layers(c: ModelConfig, w: dict) -> dict:
    """nmt's layers under transformers' names (K/V cut apart)."""
    out = {}
    for mine, theirs in layer_names(c):
        for part in ("weight", "bias"):
            for name, chunk in zip(theirs, w[f"{mine}.{part}"].chunk(len(theirs))):
                out[f"model.{name}.{part}"] = chunk.contiguous()
    return out


def _as_marian(c: ModelConfig, w: dict) -> tuple[dict, dict]:
    separate = bool(c.src_vocab_size)
    config = {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        **_common(c),
        "vocab_size": c.src_vocab_size or c.vocab_size,
        "decoder_vocab_size": c.vocab_size,
        "share_encoder_decoder_embeddings": not separate,
        "pad_token_id": PAD,
    }
    tensors = _layers(c, w)
    target = w["embed.weight"]
    if separate:
        tensors["model.encoder.embed_tokens.weight"] = w["src_embed.weight"]
        tensors["model.decoder.embed_tokens.weight"] = target
    else:
        tensors["model.shared.weight"] = target
    tensors["final_logits_bias"] = (
        w.get("output_bias", target.new_zeros(c.vocab_size)).reshape(1, -1).contiguous()
    )
    return config, tensors


def _as_m2m100(c: ModelConfig, w: dict) -> tuple[dict, dict]:
    config = {
        "model_type": "m2m_100",
        "architectures": ["M2M100ForConditionalGeneration"],
        **_common(c),
        "vocab_size": c.vocab_size,
        # M2M100's positions start at its padding id + 1: -1 starts them at 0, as nmt's do (its
        # padding is by the attention mask: the tokenizer pads with nmt's PAD)
        "pad_token_id": -1,
        "layerdrop": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
    }
    tensors = _layers(c, w)
    tensors["model.shared.weight"] = w["embed.weight"]
    for side in ("encoder", "decoder"):
        tensors[f"model.{side}.layer_norm.weight"] = w[f"{side}_norm.weight"]
        tensors[f"model.{side}.layer_norm.bias"] = w[f"{side}_norm.bias"]
    return config, tensors


def _generation(config: dict) -> dict:
    """`generate`'s defaults: nmt's (beam 4) and its rules (PAD and BOS never emitted, EOS at
    the length limit)."""
    return {
        "decoder_start_token_id": BOS,
        "eos_token_id": EOS,
        "forced_eos_token_id": EOS,
        "pad_token_id": PAD,
        "bad_words_ids": [[PAD], [BOS]],
        "num_beams": 4,
        "max_length": config["max_position_embeddings"] - 1,
    }
