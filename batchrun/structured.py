"""Structured outputs: a JSON schema, a regex, a list of choices or an EBNF grammar, compiled by xgrammar into a
matcher per request. Each step the sampler bans, batched on the logits' device, every token the matcher would
refuse; the chosen token is then accepted into the matcher, and a request whose grammar is complete stops.

Compiled grammars are cached by their source (xgrammar's compiler cache), so a schema shared by a million rows is
compiled once; the syntax check when SamplingParams is built is cached the same way.
"""
from __future__ import annotations

import functools
import json
import re
import typing

if typing.TYPE_CHECKING:
    import torch

KINDS = ("json_schema", "regex", "choice", "grammar", "json_object")


def constraint(params) -> tuple[str, str] | None:
    """(kind, source) of the params' output constraint (None: unconstrained); choices become a grammar."""
    given = [k for k in KINDS if getattr(params, k) not in (None, False)]
    if len(given) > 1:
        raise ValueError(f"{given[1]}: give one of {', '.join(KINDS)}, not {' and '.join(given)}")
    if not given:
        return None
    kind = given[0]
    value = getattr(params, kind)
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "json_schema":   # keys keep their order: properties are generated in the schema's order
        return kind, value if isinstance(value, str) else json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"choice: must be a non-empty list of non-empty strings, got {value!r}")
        return "grammar", "root ::= " + " | ".join(json.dumps(c) for c in value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind}: must be a non-empty string, got {value!r}")
    return kind, value


def from_response_format(response_format) -> dict:
    """SamplingParams keywords for OpenAI's response_format: {"type": "text" | "json_object" | "json_schema",
    "json_schema": {"name": ..., "schema": {...}}}."""
    if response_format is None:
        return {}
    kind = response_format.get("type", "text") if isinstance(response_format, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
            raise ValueError("response_format: json_schema.schema must be a JSON schema (an object)")
        return {"json_schema": inner["schema"]}
    raise ValueError(f"response_format: type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def check(params) -> None:
    """Raise ValueError naming the field when the constraint does not parse (cached per distinct source)."""
    found = constraint(params)
    if found:
        error = _syntax_error(*found)
        if error:
            field = "choice" if params.choice is not None else found[0]
            raise ValueError(f"{field}: {error}")


@functools.lru_cache(maxsize=256)
def _syntax_error(kind: str, source: str) -> str | None:
    import xgrammar as xgr
    try:
        if kind == "json_schema":
            json.loads(source)
            xgr.Grammar.from_json_schema(source, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(source)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(source)
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc})"
    except RuntimeError as exc:
        return _plain(str(exc))
    if _matches_nothing(kind, source):
        return "no text can satisfy it (its language is empty)"
    return None


@functools.lru_cache(maxsize=1)
def _byte_compiler():
    """A compiler over a vocabulary of the 256 bytes and a stop token: any text is a sequence of its tokens."""
    import xgrammar as xgr
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], stop_token_ids=[256])
    return xgr.GrammarCompiler(info)


def _matches_nothing(kind: str, source: str) -> bool:
    """True when the constraint allows neither a first byte nor the empty text. A language that dead-ends later
    (after some text) is caught while generating: that row fails (GrammarCompiler.mask)."""
    import xgrammar as xgr
    compiler = _byte_compiler()
    grammar = {"json_schema": lambda s: compiler.compile_json_schema(s, any_whitespace=False),
               "regex": compiler.compile_regex, "grammar": compiler.compile_grammar}[kind](source)
    bitmask = xgr.allocate_token_bitmask(1, 257)
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


def _plain(message: str) -> str:
    """xgrammar's C++ message without its '[time] file.cc:line: ' prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", message.strip())


class GrammarCompiler:
    """One per engine: the tokenizer's vocabulary as xgrammar sees it, and the cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size

    def matcher(self, kind: str, source: str):
        """A fresh matcher for one request (a sample of its own)."""
        compile_ = {"json_schema": lambda s: self._compiler.compile_json_schema(s, any_whitespace=False),
                    "regex": self._compiler.compile_regex, "grammar": self._compiler.compile_grammar}[kind]
        return self._xgr.GrammarMatcher(compile_(source))

    def mask(self, logits: torch.Tensor, matchers: list) -> dict[int, str]:
        """Ban, in place, each row's tokens its matcher (None: unconstrained row) would refuse. Returns the rows that
        cannot go on, with the reason: a matcher that raised, or one that allows no token at all (a dead end: no
        text continues what it generated so far)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        failed: dict[int, str] = {}
        if not rows:
            return failed
        bitmask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            try:
                matchers[i].fill_next_token_bitmask(bitmask, i)
            except Exception as exc:   # noqa: BLE001 -- one request's matcher must not end the step for the others
                failed[i] = f"structured output: the grammar matcher failed ({_plain(str(exc))})"
        allows_some = bitmask[rows].any(dim=1).tolist()
        for i, ok in zip(rows, allows_some):
            if not ok and i not in failed:
                failed[i] = ("structured output: no text satisfies the constraint after the output so far (the "
                             "grammar allows no next token)")
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
                                              indices=rows)
        return failed
