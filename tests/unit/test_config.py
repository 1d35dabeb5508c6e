import pytest

from nmt_cli.config import DecodeOptions, resolve_precision
from nmt_cli.config.model import MODEL_BOUNDS, ModelConfig
from nmt_cli.config.translation import RANGES
from nmt_cli.errors import NmtError


def test_auto_precision_is_bf16_for_gpu_training_and_fp32_for_gpu_decoding():
    """On an H100 bf16 decoding scored level with fp32 on the validation set but ran several
    times slower (docs/benchmarks.md, GPU check), so decoding's auto stays fp32 on a GPU."""
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("auto", "cuda", decoding=True) == "fp32"
    assert resolve_precision("auto", "cpu", cpu_bf16=True) == "bf16"
    assert resolve_precision("auto", "cpu", cpu_bf16=True, decoding=True) == "bf16"
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cuda", decoding=True) == "bf16"  # asked for, given
    with pytest.raises(NmtError, match="fp16 needs a GPU"):
        resolve_precision("fp16", "cpu")


def test_multi30k_takes_any_directions_of_its_four_languages():
    from nmt_cli.config import PrepConfig
    from nmt_cli.config.corpus import MANY
    from nmt_cli.data.recipes import MULTI30K_PAIRS, resolved

    six = resolved(PrepConfig("multi30k"))
    assert six.pairs == MULTI30K_PAIRS and (six.src, six.tgt) == MANY and six.many
    assert resolved(six) == six  # resolving again changes nothing
    one = resolved(PrepConfig("multi30k", src="fr", tgt="cs"))
    assert (one.pairs, one.src, one.tgt, one.many) == (("fr-cs",), "fr", "cs", False)
    assert resolved(PrepConfig("multi30k", pairs=("cs-de",))).directions() == [("cs", "de")]
    with pytest.raises(NmtError, match="give both --src and --tgt"):
        resolved(PrepConfig("multi30k", src="fr"))


def test_a_recipe_fills_its_defaults_and_refuses_other_languages():
    from nmt_cli.config import PrepConfig
    from nmt_cli.data.recipes import RECIPES, resolved

    assert resolved(PrepConfig("multi30k-en-de")).max_ratio == 9.0
    # languages not given are the recipe's: its pair, or the other side of it
    assert (resolved(PrepConfig("wmt14-en-de")).src, resolved(PrepConfig("wmt14-en-de")).tgt) == ("en", "de")
    flipped = resolved(PrepConfig("wmt14-en-de", src="de"))
    assert (flipped.src, flipped.tgt) == ("de", "en")
    assert resolved(PrepConfig("wmt14-en-de", tgt="en")).src == "de"
    own = resolved(PrepConfig("custom", src="fr", train_src=("a",), train_tgt=("b",)))
    assert (own.src, own.tgt) == ("fr", "de")
    assert resolved(PrepConfig("wmt14-en-de", src="de", tgt="en")).max_ratio == 1.5
    assert resolved(PrepConfig("multi30k-en-de", max_ratio=2.0)).max_ratio == 2.0  # the user's stays
    with pytest.raises(NmtError, match="is English-German: use --src en --tgt de"):
        resolved(PrepConfig("multi30k-en-de", src="fr"))
    with pytest.raises(NmtError, match="unknown recipe 'wmt15'"):
        resolved(PrepConfig("wmt15"))
    with pytest.raises(NmtError, match="is English-Romanian: use --src en --tgt ro"):
        resolved(PrepConfig("wmt16-en-ro", src="de"))
    for name in (n for n, known in RECIPES.items() if known.languages):  # its own pair, either way round
        forward = resolved(PrepConfig(name))
        assert forward.src and forward.tgt and forward.src != forward.tgt, name
        back = resolved(PrepConfig(name, src=forward.tgt, tgt=forward.src))
        assert (back.src, back.tgt) == (forward.tgt, forward.src), name


@pytest.mark.parametrize("name", sorted(RANGES))
def test_every_decoding_option_takes_its_range_and_nothing_beyond(name):
    lo, hi = RANGES[name]
    sampling = {"sample": True} if name in ("topk", "temperature", "seed", "nbest", "epsilon") else {}
    if name == "candidates":
        sampling = {"mbr": "chrf"}
    for value in (lo, hi):
        assert getattr(DecodeOptions(**{name: value, **sampling}), name) == value
    for value in (lo - 1 if lo >= 1 else -1e-9, hi + 1, float("nan"), float("inf"), -float("inf")):
        with pytest.raises(NmtError, match=f"--{name.replace('_', '-')} must be from"):
            DecodeOptions(**{name: value, **sampling})


@pytest.mark.parametrize("name", sorted(MODEL_BOUNDS))
def test_every_model_setting_takes_its_bounds_and_nothing_beyond(name):
    lo, hi = MODEL_BOUNDS[name]
    fits = {"heads": 1} if name == "d_model" else {"d_model": 256} if name == "heads" else {}
    for value in (lo, hi):
        assert getattr(ModelConfig(**{"vocab_size": 100, **fits, name: value}), name) == value
    for value in (lo - 1, hi + 1, float(hi), True, "8"):
        with pytest.raises(NmtError, match=f"model setting {name} must be an integer from {lo} to {hi}"):
            ModelConfig(**{"vocab_size": 100, **fits, name: value})


def test_the_settings_of_models_made_elsewhere_take_their_values_and_nothing_beyond():
    ModelConfig(vocab_size=100, activation="swish", norm_eps=1e-5, positions="marian", output_bias=True)
    for setting, said in (
        (dict(activation="tanh"), "activation"),
        (dict(positions="learned"), "positions"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(norm_eps="1e-5"), "norm_eps"),
        (dict(output_bias=1), "output_bias"),
        (dict(scale_embedding="yes"), "scale_embedding"),
    ):
        with pytest.raises(NmtError, match=f"model setting {said}"):
            ModelConfig(vocab_size=100, **setting)


def test_freeze_and_adapters_take_what_they_can_and_refuse_the_rest():
    from nmt_cli.config import TrainConfig

    TrainConfig(freeze="embeddings,encoder,decoder.3", adapters=8, init_from="x")
    for settings, said in (
        (dict(freeze="embedding"), "--freeze 'embedding' names no part"),
        (dict(freeze="encoder.x"), "names no part"),
        (dict(adapters=-1, init_from="x"), "--adapters is a rank"),
        (dict(adapters=8), "give it with --init-from"),
        (dict(adapters=8, init_from="x", ema=0.999), "--ema"),
        (dict(adapters=8, init_from="x", init_optimizer=True), "--init-optimizer"),
        (dict(adapters=8, init_from="x", fused_qkv=True), "--fused-qkv"),
    ):
        with pytest.raises(NmtError, match=said):
            TrainConfig(**settings)
