"""What the simulated engine says, beyond free text: tool calls, JSON, and token log-probabilities.

The engine model decides how many tokens each step yields; this module decides which. Free text
comes from `router.sim.text` and ends where the engine model says. A tool call or a JSON answer
is written whole first and then handed out token by token, so it ends where the JSON ends (or is
cut at `max_tokens`, as a real engine's would be).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from router.content import request_text
from router.sim.text import tokens as text_tokens

# A token of JSON or code: a word or a symbol with the spaces before it.
_PIECE = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")
# A name inside a sentence ("the weather in Lisbon"): what a prompt most likely wants looked up.
_NAME = re.compile(r"(?<=[a-z,] )[A-Z][a-z]+(?: [A-Z][a-z]+)*")
# Keywords that only describe a schema: an answer satisfies them whatever it holds.
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "additionalProperties", "strict",
     "required", "propertyOrdering", "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "nullable"}
)  # fmt: skip
_HANDLED = frozenset(
    {"type", "properties", "items", "enum", "const", "anyOf", "oneOf", "$ref", "minItems", "maxItems", "minimum",
     "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "format"}
)  # fmt: skip
_FORMATS = {
    "date-time": "2026-01-15T09:30:00Z",
    "date": "2026-01-15",
    "time": "09:30:00",
    "email": "ada@example.com",
    "uri": "https://example.com/tides",
    "uuid": "3f2b8c1e-9a4d-4e6f-8b7a-2c5d1e0f9a3b",
}
_MAX_DEPTH = 12
_MAX_ITEMS = 64


class Unsupported(ValueError):
    """Something the simulator does not model; the message says what."""


def pieces(text: str) -> list[str]:
    """Text cut into pieces that each stand for one token; they join back to the text exactly."""
    return _PIECE.findall(text)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    # A tool named in `tool_choice` finishes with "stop", one the model chose with "tool_calls".
    named: bool


def choose_tool(body: dict[str, Any]) -> ToolCall | None:
    """The tool call a chat request gets, if any (the tools are validated already).

    `tool_choice` "required" or a named tool always calls one. With "auto" (the default when
    tools are given) the model calls a tool when the last message is the user's and names one
    of the tools (`get_weather` or "get weather"), or asks for a tool or function call; an answer
    to a tool's result is text."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice", "auto" if tools else "none")
    if not tools or choice == "none":
        return None
    functions = [tool["function"] for tool in tools]
    messages = body.get("messages") or []
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    prompt = request_text({"messages": [last]})
    if isinstance(choice, dict):
        function = next(f for f in functions if f["name"] == choice["function"]["name"])
        return ToolCall(function["name"], _arguments(function, prompt), named=True)
    lowered = prompt.lower()
    mentioned = [f for f in functions if f["name"].lower() in lowered or f["name"].replace("_", " ").lower() in lowered]
    asks = re.search(r"\b(call|use|invoke|run)\b.*\b(tool|function)s?\b", lowered) is not None
    if choice == "required" or (last.get("role") == "user" and (mentioned or asks)):
        function = (mentioned or functions)[0]
        return ToolCall(function["name"], _arguments(function, prompt), named=False)
    return None


def _arguments(function: dict[str, Any], prompt: str) -> str:
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    names = _NAME.findall(prompt)
    value = instance(schema, random.Random(function["name"]), subject=names[0] if names else None)
    return json.dumps(value, ensure_ascii=False)


def json_answer(response_format: dict[str, Any], rng: random.Random) -> str:
    """The JSON text answering `response_format` `json_object` or `json_schema`."""
    if response_format.get("type") == "json_schema":
        schema = response_format["json_schema"].get("schema") or {}
        return json.dumps(instance(schema, rng), ensure_ascii=False)
    sentences = _sentences(rng)
    answer = {"title": _words(rng, 3), "summary": next(sentences), "points": [next(sentences) for _ in range(3)]}
    return json.dumps(answer, ensure_ascii=False)


def instance(schema: Any, rng: random.Random, *, subject: str | None = None) -> Any:
    """A value that a simple JSON schema accepts, or `Unsupported` naming what is not simple."""
    return _Instance(schema, rng, subject).of(schema, 0)


class _Instance:
    def __init__(self, root: Any, rng: random.Random, subject: str | None) -> None:
        self._root = root
        self._rng = rng
        self._subject = subject  # a name from the prompt for the first string wanted

    def of(self, schema: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise Unsupported(f"the schema nests deeper than {_MAX_DEPTH} levels")
        if schema is True or schema == {}:
            return self._string()
        if not isinstance(schema, dict):
            raise Unsupported("a schema must be an object")
        unknown = sorted(set(schema) - _ANNOTATIONS - _HANDLED)
        if unknown:
            raise Unsupported(f"the schema keyword {unknown[0]!r}")
        if "$ref" in schema:
            return self.of(self._resolve(schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise Unsupported("an empty `enum`")
            return schema["enum"][0]
        for key in ("anyOf", "oneOf"):
            if key in schema:
                if not isinstance(schema[key], list):
                    raise Unsupported(f"a `{key}` that is not a list")
                options = [o for o in schema[key] if not (isinstance(o, dict) and o.get("type") == "null")]
                return self.of(options[0] if options else {"type": "null"}, depth + 1)
        kind = schema.get("type", "object" if "properties" in schema else "string")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind == "object":
            properties = schema.get("properties") or {}
            if not isinstance(properties, dict):
                raise Unsupported("`properties` that are not an object")
            return {name: self.of(sub, depth + 1) for name, sub in properties.items()}
        if kind == "array":
            low, high = schema.get("minItems", 0), schema.get("maxItems", _MAX_ITEMS)
            if not isinstance(low, int) or not isinstance(high, int) or low > high:
                raise Unsupported("array bounds that are not a range")
            if low > _MAX_ITEMS:
                raise Unsupported(f"arrays of more than {_MAX_ITEMS} items")
            count = max(low, min(high, 2))
            return [self.of(schema.get("items", {}), depth + 1) for _ in range(count)]
        if kind in ("integer", "number"):
            return self._number(schema, integer=kind == "integer")
        if kind == "boolean":
            return True
        if kind == "null":
            return None
        if kind == "string":
            return self._string(schema)
        raise Unsupported(f"the schema type {kind!r}")

    def _resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise Unsupported(f"the reference {ref!r} (only references within the schema are followed)")
        target = self._root
        for part in filter(None, ref[1:].split("/")):
            if not isinstance(target, dict) or part not in target:
                raise Unsupported(f"the reference {ref!r}, which names nothing in the schema")
            target = target[part]
        return target

    def _number(self, schema: dict[str, Any], *, integer: bool) -> float | int:
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        if not all(isinstance(bound, int | float | None) for bound in (low, high)):
            raise Unsupported("a bound that is not a number")
        low = high - 100 if low is None and high is not None else low or 0
        high = low + 100 if high is None else high
        value = (low + high) / 2
        return math.floor(value) if integer else round(value, 2)

    def _string(self, schema: dict[str, Any] | None = None) -> str:
        schema = schema or {}
        if "format" in schema:
            if schema["format"] not in _FORMATS:
                raise Unsupported(f"the string format {schema['format']!r}")
            return _FORMATS[schema["format"]]
        if self._subject is not None:
            text, self._subject = self._subject, None
        else:
            text = _words(self._rng, self._rng.randint(2, 5))
        low, high = schema.get("minLength", 0), schema.get("maxLength", 1 << 30)
        if not isinstance(low, int) or not isinstance(high, int) or low > high or low > 4096:
            raise Unsupported("a string of that length")
        if len(text) < low:
            text = (text + " " + "x" * low)[:low]
        return text[:high]


def _words(rng: random.Random, count: int) -> str:
    words = (piece.strip() for piece in text_tokens("prose", rng) if piece.strip())
    return " ".join(itertools.islice(words, count)).strip(" .")


def _sentences(rng: random.Random) -> Iterator[str]:
    sentence: list[str] = []
    for piece in text_tokens("prose", rng):
        if piece.strip():
            sentence.append(piece.strip())
        if piece.endswith("."):
            yield " ".join(sentence)
            sentence = []


class Logprobs:
    """Plausible log-probabilities for a choice's tokens: mostly confident, now and then not.

    Each token's runner-up alternatives are other tokens with less probability left to share;
    the sampled token is the most likely one, so it heads the list of top log-probabilities."""

    _ALTERNATIVES = (" the", " a", ",", ".", " and", " of", " to", " in", " it", " was", "\n", " that", " is",
                     " for", " on", " with", " as", " at", " by", " from", " this")  # fmt: skip

    def __init__(self, rng: random.Random, top: int) -> None:
        self._rng = rng
        self.top = top

    def token(self, token: str) -> tuple[float, list[tuple[str, float]]]:
        """The sampled token's log-probability, and the `max(top, 1)` most likely tokens."""
        rng = self._rng
        p = 1.0 - 0.7 * rng.random() ** 3
        shares: list[tuple[float, str]] = []
        rest = 1.0 - p
        for alternative in rng.sample(self._ALTERNATIVES, min(self.top, len(self._ALTERNATIVES))):
            if len(shares) + 1 >= self.top:
                break
            if alternative != token:
                share = rest * rng.uniform(0.3, 0.7)
                rest -= share
                shares.append((min(share, p), alternative))
        shares.sort(reverse=True)
        ranked = [(token, math.log(p)), *((alternative, math.log(share)) for share, alternative in shares)]
        return ranked[0][1], ranked
