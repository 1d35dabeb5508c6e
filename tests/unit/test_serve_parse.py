"""The server's reading of a request: every decoding option a request may set is a field of
DecodeOptions, checked by DecodeOptions' own rules, named as the request spells it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nmt_cli.config import DecodeOptions, ServeConfig
from nmt_cli.serve import MAX_BEAM, parse

DEFAULTS = DecodeOptions(beam=5)


def request(**fields) -> bytes:
    return json.dumps({"text": ["a b c"], **fields}).encode()


def test_every_decoding_option_is_a_request_field():
    for field in dataclasses.fields(DecodeOptions):
        value = getattr(DEFAULTS, field.name)
        text, options = parse(request(**{field.name: value}), ServeConfig(), DEFAULTS)
        assert text == ["a b c"] and options == DEFAULTS, field.name


def test_a_request_sets_its_own_options_and_keeps_the_servers_for_the_rest():
    _, options = parse(request(nbest=2, alpha=1), ServeConfig(), DEFAULTS)
    assert options == dataclasses.replace(DEFAULTS, nbest=2, alpha=1.0)
    assert isinstance(options.alpha, float)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"beam": 0}, '"beam" must be at least 1'),
        ({"beam": 2, "nbest": 3}, '"nbest" 3 exceeds "beam" 2'),
        ({"beam": True}, '"beam" must be an integer'),
        ({"beam": 2.0}, '"beam" must be an integer'),
        ({"alpha": "1"}, '"alpha" must be a number'),
        ({"max_len_a": -1}, '"max_len_a" must not be negative'),
        ({"beam": MAX_BEAM + 1}, f'"beam" must be at most {MAX_BEAM}'),
        ({"width": 1}, "unknown field(s): width"),
    ],
)
def test_a_bad_option_is_refused_naming_it(fields, message):
    with pytest.raises(ValueError) as refused:
        parse(request(**fields), ServeConfig(), DEFAULTS)
    assert message in str(refused.value)
