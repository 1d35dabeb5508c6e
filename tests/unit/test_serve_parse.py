"""The server's reading of a request: every decoding option a request may set is a field of
DecodeOptions, checked by DecodeOptions' own rules, named as the request spells it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nmt_cli.config import DecodeOptions, ServeConfig
from nmt_cli.inference.backend import FASTER, Choice
from nmt_cli.serve.requests import MAX_CONSTRAINT_CHARS, MAX_CONSTRAINTS, parse

DEFAULTS = DecodeOptions(beam=5)


def request(**fields) -> bytes:
    return json.dumps({"text": ["a b c"], **fields}).encode()


# A value other than the server's default for every decoding option, and the options it needs
# beside it (a sampling option needs "sample").
CHANGED = {
    "beam": (6, {}),
    "alpha": (1.5, {}),
    "max_len_a": (2.0, {}),
    "max_len_b": (7, {}),
    "max_len": (9, {}),
    "min_len": (3, {}),
    "no_repeat_ngram": (2, {}),
    "repetition_penalty": (1.3, {}),
    "coverage_penalty": (0.4, {}),
    "nbest": (2, {}),
    "scores": (True, {}),
    "sample": (True, {}),
    "topk": (5, {"sample": True}),
    "topp": (0.8, {"sample": True}),
    "temperature": (0.7, {"sample": True}),
    "epsilon": (0.02, {"sample": True}),
    "seed": (9, {}),
    "mbr": ("bleu", {}),
    "candidates": (8, {"mbr": "chrf"}),
    "alignments": (True, {}),
    "tag": ("<bt>", {}),
    "src_lang": ("fr", {}),
    "tgt_lang": ("de", {}),
    "rerank": ("kiwi", {}),
}
# Options a request may name but the server refuses in one line: they need a second model
REFUSED = {"rerank"}


def test_every_decoding_option_is_a_request_field():
    """Each option a request sets reaches the search, the rest stay the server's defaults; a
    new DecodeOptions field must be added here."""
    assert set(CHANGED) == {f.name for f in dataclasses.fields(DecodeOptions)}
    for name, (value, needs) in CHANGED.items():
        assert value != getattr(DEFAULTS, name), name
        if name in REFUSED:
            with pytest.raises(ValueError, match="which the server does not load"):
                parse(request(**{name: value}, **needs), ServeConfig(), DEFAULTS)
            continue
        languages = ("de", "fr") if name.endswith("_lang") else ()  # a multilingual model's options
        asked = parse(
            request(**{name: value}, **needs), ServeConfig(), DEFAULTS, tags=("<bt>",), languages=languages
        )
        assert asked.text == ["a b c"], name
        assert asked.options == dataclasses.replace(DEFAULTS, **{name: value}, **needs), name


def test_a_request_sets_its_own_options_and_keeps_the_servers_for_the_rest():
    options = parse(request(nbest=2, alpha=1), ServeConfig(), DEFAULTS).options
    assert options == dataclasses.replace(DEFAULTS, nbest=2, alpha=1.0)
    assert isinstance(options.alpha, float)
    assert parse(request(prefix=["Ein"]), ServeConfig(), DEFAULTS).prefixes == ["Ein"]
    assert parse(request(constraints=[["Hund", "rote Ball"]]), ServeConfig(), DEFAULTS).constraints == [
        ["Hund", "rote Ball"]
    ]


def test_languages_are_a_multilingual_models_own():
    with pytest.raises(ValueError, match="\"tgt_lang\" 'cs' is not a language of this model"):
        parse(request(tgt_lang="cs"), ServeConfig(), DEFAULTS, languages=("de", "fr"))
    with pytest.raises(ValueError, match="of a multilingual model's translations: not yet"):
        parse(request(alignments=True), ServeConfig(), DEFAULTS, languages=("de", "fr"))
    with pytest.raises(ValueError, match="this one translates one pair"):
        parse(request(src_lang="de"), ServeConfig(), DEFAULTS)


def test_a_model_of_several_directions_is_told_its_target_alone():
    many = {"targets": ("de", "en", "fr")}
    assert parse(request(tgt_lang="fr"), ServeConfig(), DEFAULTS, **many).options.tgt_lang == "fr"
    with pytest.raises(ValueError, match="\"tgt_lang\" 'cs': this model translates into de, en, fr"):
        parse(request(tgt_lang="cs"), ServeConfig(), DEFAULTS, **many)
    with pytest.raises(ValueError, match='"src_lang": this model of several directions is told the target'):
        parse(request(src_lang="en", tgt_lang="fr"), ServeConfig(), DEFAULTS, **many)


def test_a_ctranslate2_server_refuses_what_ctranslate2_lacks():
    ct2 = Choice("ctranslate2", FASTER)
    with pytest.raises(
        ValueError, match="this server decodes with ctranslate2 .auto.*start it with --engine nmt"
    ):
        parse(request(constraints=[["Hund"]]), ServeConfig(), DEFAULTS, engine=ct2)
    with pytest.raises(ValueError, match="epsilon.*--engine nmt"):
        parse(request(sample=True, epsilon=0.02), ServeConfig(), DEFAULTS, engine=ct2)
    assert parse(request(constraints=[[]]), ServeConfig(), DEFAULTS, engine=ct2).constraints == [[]]
    nmt = Choice("nmt", "--engine nmt")
    assert parse(request(constraints=[["Hund"]]), ServeConfig(), DEFAULTS, engine=nmt).constraints


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"beam": 0}, '"beam" must be from 1 to 1000, not 0'),
        ({"beam": 2, "nbest": 3}, '"nbest" 3 exceeds "beam" 2'),
        ({"beam": True}, '"beam" must be an integer'),
        ({"beam": 2.0}, '"beam" must be an integer'),
        ({"alpha": "1"}, '"alpha" must be a number'),
        ({"max_len_a": -1}, '"max_len_a" must be from 0 to 100, not -1'),
        ({"alpha": float("nan")}, '"alpha" must be from 0 to 10, not nan'),
        ({"alpha": float("inf")}, '"alpha" must be from 0 to 10, not inf'),
        ({"alpha": 1e308}, '"alpha" must be from 0 to 10'),
        ({"max_len_b": 10**399}, '"max_len_b" must be from 0 to 100000, not a number of 400 digits'),
        ({"max_len": -1}, '"max_len" must be from 0 to 100000'),
        ({"sample": True, "seed": -5}, '"seed" must be from 0 to 4294967295, not -5'),
        ({"sample": True, "topk": 10**50}, '"topk" must be from 0 to 100000'),
        ({"sample": True, "temperature": 1e-300}, '"temperature" must be from 1e-06 to 100'),
        ({"sample": True, "topp": float("nan")}, '"topp" must be in (0, 1], not nan'),
        ({"beam": 17}, '"beam" must be at most 16 on this server (--max-beam)'),
        ({"sample": True, "nbest": 17}, '"nbest" must be at most 16 on this server (--max-beam)'),
        ({"width": 1}, "unknown field(s): width"),
        ({"prefix": "Ein"}, '"prefix" must be a list of strings, one per sentence'),
        ({"prefix": ["Ein", "Zwei"]}, '"prefix" must be a list of strings, one per sentence'),
        ({"prefix": ["x" * 3000]}, "prefix 0 has 3000 characters"),
        (
            {"constraints": ["Hund"]},
            '"constraints" must be a list of lists of strings, one list per sentence',
        ),
        (
            {"constraints": [[], []]},
            '"constraints" must be a list of lists of strings, one list per sentence',
        ),
        ({"constraints": [[1]]}, '"constraints" must be a list of lists of strings'),
        ({"constraints": [["x" * 3000]]}, f"more than {MAX_CONSTRAINT_CHARS} characters in all"),
        ({"constraints": [["Hund"] * (MAX_CONSTRAINTS + 1)]}, f"more than {MAX_CONSTRAINTS} constraints"),
        ({"constraints": [["x" * 300, "y" * 101]]}, f"more than {MAX_CONSTRAINT_CHARS} characters in all"),
        (
            {"constraints": [["Hund"]], "sample": True, "nbest": 1},
            '"constraints" are met by nmt\'s beam search: drop "sample"',
        ),
        # JSON's escapes can spell half a character: a string that is no text (it was a 500)
        ({"text": ["a \ud800"]}, "sentence 0 holds a lone surrogate ('\\ud800')"),
        ({"prefix": ["\udfff"]}, "prefix 0 holds a lone surrogate"),
        ({"constraints": [["x\ud800"]]}, "a constraint of sentence 0 holds a lone surrogate"),
    ],
)
def test_a_bad_option_is_refused_naming_it(fields, message):
    with pytest.raises(ValueError) as refused:
        parse(request(**fields), ServeConfig(), DEFAULTS)
    assert message in str(refused.value)


def test_the_operator_caps_the_output_length_of_every_request():
    capped = ServeConfig(max_output_len=40)
    assert parse(request(), capped, DEFAULTS).options.max_len == 40  # the cap is the default
    assert parse(request(max_len=12), capped, DEFAULTS).options.max_len == 12
    with pytest.raises(ValueError, match='"max_len" must be at most 40 on this server'):
        parse(request(max_len=41), capped, DEFAULTS)
    assert parse(request(), ServeConfig(), DEFAULTS).options.max_len == 0  # no cap: the model's


@pytest.mark.parametrize("name", ["max_len", "min_len", "max_len_b"])
def test_no_length_a_request_asks_for_passes_the_output_cap(name):
    """A min_len or max_len_b past the cap would keep every row decoding to the model's limit
    (the cap: --max-output-len, else the model's own limit)."""
    with pytest.raises(ValueError, match=f'"{name}" must be at most 40 on this server'):
        parse(request(**{name: 41}), ServeConfig(max_output_len=40), DEFAULTS)
    assert getattr(parse(request(**{name: 40}), ServeConfig(max_output_len=40), DEFAULTS).options, name) == 40
    with pytest.raises(ValueError, match=f'"{name}" must be at most 63 on this server'):
        parse(request(**{name: 64}), ServeConfig(), DEFAULTS, ceiling=63)
    with pytest.raises(ValueError, match=f'"{name}" must be at most 63 on this server'):
        parse(request(**{name: 64}), ServeConfig(max_output_len=100), DEFAULTS, ceiling=63)


def test_a_request_takes_only_a_tag_the_model_was_trained_with():
    assert parse(request(tag="<bt>"), ServeConfig(), DEFAULTS, ("<bt>",)).options.tag == "<bt>"
    with pytest.raises(ValueError, match="\"tag\" '<xx>' is not a tag of this model: <bt>"):
        parse(request(tag="<xx>"), ServeConfig(), DEFAULTS, ("<bt>",))
    with pytest.raises(ValueError, match="it has none"):
        parse(request(tag="<bt>"), ServeConfig(), DEFAULTS)


def test_the_servers_log_lines_are_rate_limited(capsys, monkeypatch):
    """A client sending malformed requests in a loop gets a bounded number of log lines."""
    import logging

    from nmt_cli.serve import connections

    now = [0.0]
    monkeypatch.setattr(connections.time, "monotonic", lambda: now[0])
    handler = connections._OneLine(burst=3, window=10.0)
    said = "Error handling request"
    record = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, said, None, None)
    for _ in range(50):
        handler.emit(record)
    now[0] = 11.0
    handler.emit(record)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [said] * 3 + ["(47 more lines like these left out)", said]


def test_the_memory_the_searches_may_hold_is_derived_from_the_machine_unless_given():
    from nmt_cli.serve.batcher import memory_budget

    assert memory_budget(1024, available=64 << 30) == 1024 << 20  # as given
    assert memory_budget(0, available=24 << 30) == 12 << 30  # half of what is available
    assert memory_budget(0, available=100 << 20) == 256 << 20  # at least 256 MiB
    assert 256 << 20 <= memory_budget(0)  # read from this machine
