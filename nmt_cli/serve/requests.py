"""What `nmt serve` reads of a request: its sentences, their prefixes and constraints, and its
decoding options, each checked (a refusal is ValueError for 400, OverflowError for 413)."""

from __future__ import annotations

import dataclasses
import json
import re

from nmt_cli.config import DecodeOptions, ServeConfig
from nmt_cli.errors import NmtError
from nmt_cli.inference.backend import Choice, refusal

# each constraint adds a bank to a sentence's search, and every token of them raises its length
# limit: enough for terminology, not a way to stall it
MAX_CONSTRAINTS = 16
MAX_CONSTRAINT_CHARS = 400  # all of one sentence's phrases together


@dataclasses.dataclass(frozen=True)
class Request:
    text: list[str]
    options: DecodeOptions
    prefixes: list[str] | None = None  # what each translation begins with
    constraints: list[list[str]] | None = None  # the phrases each translation contains


def parse(
    body: bytes,
    config: ServeConfig,
    defaults: DecodeOptions,
    tags: tuple[str, ...] = (),
    engine: Choice = Choice("nmt", "--engine nmt"),
    ceiling: int = 1023,
    languages: tuple[str, ...] = (),
    targets: tuple[str, ...] = (),
) -> Request:
    """The request's sentences, their prefixes and constraints, and its decoding options (any
    field of DecodeOptions, `defaults` for the rest), for a model with `tags` decoded by
    `engine` whose outputs have at most `ceiling` tokens, of `languages` (a multilingual
    model's codes) or trained into `targets` (a run of several directions, told the target
    alone); ValueError (400) or OverflowError (413)."""
    data = _json(body)
    fields = {f.name: f for f in dataclasses.fields(DecodeOptions)}
    unknown = set(data) - {"text", "prefix", "constraints"} - set(fields)
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    text, prefixes, constraints = _sentences(data, config)
    options = _options(data, defaults, fields)
    if options.tag and options.tag not in tags:
        raise ValueError(
            f'"tag" {options.tag!r} is not a tag of this model: ' + (", ".join(tags) or "it has none")
        )
    for name in ("src_lang", "tgt_lang"):
        asked = getattr(options, name)
        if not asked:
            continue
        if targets:  # a run of several directions, told its target alone
            if name == "src_lang":
                raise ValueError(
                    '"src_lang": this model of several directions is told the target alone ("tgt_lang")'
                )
            if asked not in targets:
                raise ValueError(f'"tgt_lang" {asked!r:.40}: this model translates into {", ".join(targets)}')
        elif not languages:
            raise ValueError(
                f'"{name}" chooses a language of a multilingual model: this one translates one pair'
            )
        elif asked not in languages:
            some = ", ".join(languages[:6])
            raise ValueError(f'"{name}" {asked!r:.40} is not a language of this model ({some}, …)')
    if options.alignments and languages:
        raise ValueError('"alignments" of a multilingual model\'s translations: not yet')
    constrained = any(constraints or [])
    if constrained and options.sample:
        raise ValueError('"constraints" are met by nmt\'s beam search: drop "sample"')
    lacking = refusal(engine.engine, options, constrained)
    if lacking:  # the one list of what an engine lacks (backend.refusal), as the CLI reads it
        raise ValueError(f"{lacking}, and this server decodes with {engine}: start it with --engine nmt")
    # what a request may cost, bounded by the operator: a min_len or max_len_b past the output
    # cap would keep every row decoding to the model's limit for nothing
    cap = min(config.max_output_len or ceiling, ceiling)
    for name in ("max_len", "min_len", "max_len_b"):
        if name in data and getattr(options, name) > cap:
            raise ValueError(f'"{name}" must be at most {cap} on this server (--max-output-len)')
    if config.max_output_len:
        options = dataclasses.replace(options, max_len=options.max_len or config.max_output_len)
    if options.mbr == "comet" or options.rerank:  # a second model of its own, and its memory
        raise ValueError(
            f'"{"mbr" if options.mbr else "rerank"}": "{options.mbr or options.rerank}" needs a COMET model, '
            "which the server does not load: use `nmt translate --comet/--kiwi`"
        )
    if options.rows > config.max_beam:
        raise ValueError(
            f'"{_widest(options)}" must be at most {config.max_beam} on this server (--max-beam)'
        )
    if len(text) * options.rows > config.max_hypotheses:
        raise OverflowError(
            f"{len(text)} sentences at beam {options.rows} are {len(text) * options.rows} hypotheses; "
            f"the limit is {config.max_hypotheses} (--max-hypotheses): send fewer sentences or a "
            "narrower beam"
        )
    return Request(text, options, prefixes, constraints)


def _json(body: bytes) -> dict:
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("the body is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the body is not JSON ({e})") from None
    except RecursionError:  # thousands of nested brackets: the parser recurses once per level
        raise ValueError("the body is JSON nested too deeply") from None
    if not isinstance(data, dict) or "text" not in data:
        raise ValueError('expected a JSON object {"text": ["sentence", ...]}')
    return data


def _sentences(data: dict, config: ServeConfig) -> tuple[list[str], list[str] | None, list[list[str]] | None]:
    """The request's "text", "prefix" and "constraints", taken out of `data`."""
    text = data.pop("text")
    if not isinstance(text, list) or not all(isinstance(s, str) for s in text):
        raise ValueError('"text" must be a list of strings')
    if not text:
        raise ValueError('"text" is empty')
    if len(text) > config.max_sentences:
        raise OverflowError(f"{len(text)} sentences in one request; the limit is {config.max_sentences}")
    prefixes = data.pop("prefix", None)
    if prefixes is not None and (
        not isinstance(prefixes, list)
        or len(prefixes) != len(text)
        or not all(isinstance(p, str) for p in prefixes)
    ):
        raise ValueError('"prefix" must be a list of strings, one per sentence of "text" ("" for none)')
    constraints = _constraints(data.pop("constraints", None), len(text))
    for what, s in (
        [*((f"sentence {i}", s) for i, s in enumerate(text))]
        + [*((f"prefix {i}", p) for i, p in enumerate(prefixes or []))]
        + [(f"a constraint of sentence {i}", p) for i, c in enumerate(constraints or []) for p in c]
    ):
        if len(s) > config.max_chars:
            raise ValueError(f"{what} has {len(s)} characters; the limit is {config.max_chars}")
        try:  # JSON's \ud800 escapes give a string that is no text: a lone surrogate
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} holds a lone surrogate ({s[e.start]!a}), which is not text") from None
    return text, prefixes, constraints


def _options(data: dict, defaults: DecodeOptions, fields: dict) -> DecodeOptions:
    """`defaults` with the request's decoding fields, each type-checked and then checked by
    DecodeOptions' own rules, named as the request spells them."""
    for name, value in data.items():
        kind = fields[name].type
        if not isinstance(value, _json_types(kind)) or isinstance(value, bool) != ("bool" in kind):
            raise ValueError(f'"{name}" must be {_described(kind)}')
        if "float" in kind and isinstance(value, int):
            data[name] = float(value)
    try:
        return dataclasses.replace(defaults, **data)
    except NmtError as e:
        raise ValueError(re.sub(r"--([a-z0-9-]+)", lambda m: f'"{m[1].replace("-", "_")}"', str(e))) from None


def _constraints(given, sentences: int) -> list[list[str]] | None:
    """The request's "constraints": per sentence, a list of the phrases its translation must
    contain ([] for none)."""
    if given is None:
        return None
    if (
        not isinstance(given, list)
        or len(given) != sentences
        or not all(isinstance(c, list) and all(isinstance(p, str) for p in c) for c in given)
    ):
        raise ValueError(
            '"constraints" must be a list of lists of strings, one list per sentence of "text" ([] for none)'
        )
    if max(map(len, given)) > MAX_CONSTRAINTS:
        raise ValueError(f"a sentence has more than {MAX_CONSTRAINTS} constraints")
    if max(sum(map(len, c)) for c in given) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"a sentence's constraints have more than {MAX_CONSTRAINT_CHARS} characters in all")
    return given


# A field's type: the JSON values it takes (a float takes 1 as 1.0), and what to call them.
JSON_TYPES = {
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "bool": ((bool,), "true or false"),
    "str": ((str,), "a string"),
    "None": ((type(None),), "null"),
}


def _json_types(annotation: str) -> tuple[type, ...]:
    return tuple(t for name in annotation.split(" | ") for t in JSON_TYPES[name][0])


def _described(annotation: str) -> str:
    return " or ".join(JSON_TYPES[name][1] for name in annotation.split(" | "))


def _widest(options: DecodeOptions) -> str:
    """The field of `options` that sets its rows (DecodeOptions.rows), as a request spells it."""
    if options.chooses and (options.sample or options.pool >= options.beam):
        return "candidates"
    return "nbest" if options.sample else "beam"
