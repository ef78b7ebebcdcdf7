"""Reading a request to the simulated engine: what vLLM accepts, what it refuses, and what the
simulator does not model (refused with a message that says so, never ignored in silence).

Errors use vLLM's envelope: `{"error": {"message", "type", "param", "code"}}`. Something the
simulator does not model is a 400 for a parameter and a 404 for an endpoint, not vLLM's 501:
the OpenAI clients retry any 5xx, and a retried refusal only makes a demo slower.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from router.content import ContentKind, detect_kind, request_text
from router.sim import cache
from router.sim.outputs import ToolCall, Unsupported, choose_tool, json_answer
from router.sim.profile import Profile

MAX_LOGPROBS = 20  # vLLM's default `--max-logprobs`
SIMULATOR = "the specroute engine simulator"

# Parameters that change what an answer holds, which the simulator does not produce: refused
# when set (to anything but their default). Sampling parameters (temperature, top_p, seed,
# stop, penalties...) are accepted and change nothing: the simulated text is not sampled.
_UNSUPPORTED = {
    "echo": "echoing the prompt",
    "suffix": "`suffix`",
    "use_beam_search": "beam search",
    "prompt_logprobs": "prompt log-probabilities",
    "return_token_ids": "token ids",
    "audio": "audio output",
    "structured_outputs": "`structured_outputs` (use `response_format`)",
    "guided_json": "`guided_json` (use `response_format`)",
    "guided_regex": "`guided_regex`",
    "guided_choice": "`guided_choice`",
    "guided_grammar": "`guided_grammar`",
    "prediction": "predicted outputs",
}


class EngineError(Exception):
    def __init__(self, message: str, *, status: int = 400, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status)


def not_supported(what: str, *, param: str | None = None) -> EngineError:
    return EngineError(f"{SIMULATOR[0].upper()}{SIMULATOR[1:]} does not support {what}.", param=param)


@dataclass(frozen=True, slots=True)
class Params:
    chat: bool
    prompts: tuple[int, ...]  # the prompt tokens of each prompt (completions take several)
    blocks: tuple[tuple[bytes, ...], ...]  # each prompt's full blocks, hashed (router.sim.cache)
    tails: tuple[tuple[str, ...] | None, ...]  # each prompt's tokens after its last full block
    kind: ContentKind
    n: int
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage on every chunk too (vLLM's `stream_options.continuous_usage_stats`)
    logprobs: int | None  # None: none asked; else how many top log-probabilities per token
    response_format: dict[str, Any] | None  # json_object or json_schema, checked
    tool: ToolCall | None
    request_id: str | None  # the body's `request_id` (vLLM's), the base of the answer's id

    @property
    def choices(self) -> int:
        return self.n * len(self.prompts)


def load(raw: bytes, profile: Profile) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise EngineError(f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise EngineError("The request body must be a JSON object.")
    if body.get("model") != profile.model:
        raise EngineError(
            f"The model `{body.get('model')}` does not exist.", status=404, kind="NotFoundError", param="model"
        )
    return body


def parse(raw: bytes, profile: Profile, *, chat: bool) -> Params:
    body = load(raw, profile)
    for name, what in _UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise not_supported(what, param=name)
    if body.get("best_of") not in (None, 1):
        raise not_supported("`best_of`", param="best_of")
    modalities = body.get("modalities")
    if isinstance(modalities, list) and "audio" in modalities:
        raise not_supported("audio output", param="modalities")
    tokens: tuple[list[str], ...]
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EngineError("`messages` must be a non-empty list.", param="messages")
        tokens = (cache.chat_tokens(messages),)
    else:
        tokens = _completion_prompts(body.get("prompt"))
    prompts = tuple(len(t) for t in tokens)
    size = profile.block_size
    blocks = tuple(cache.block_hashes(t, size) if profile.prefix_caching else () for t in tokens)
    tails = tuple(cache.tail(t, size) if profile.prefix_caching else None for t in tokens)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise EngineError("max_tokens must be at least 1.", param="max_tokens")
    longest = max(prompts)
    if max_tokens is not None and longest + max_tokens > profile.max_model_len:
        raise EngineError(
            f"This model's maximum context length is {profile.max_model_len} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or n < 1:
        raise EngineError("n must be at least 1.", param="n")
    if n * len(prompts) > profile.max_num_seqs:
        raise not_supported(f"more than {profile.max_num_seqs} choices in one request (its max_num_seqs)", param="n")
    min_tokens = body.get("min_tokens", 0)
    if not _is_int(min_tokens) or min_tokens < 0:
        raise EngineError("min_tokens must be a non-negative integer.", param="min_tokens")
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    if options and not stream:
        raise EngineError("Stream options can only be defined when `stream=True`.", param="stream_options")
    text = request_text(body)
    return Params(
        chat=chat,
        prompts=prompts,
        blocks=blocks,
        tails=tails,
        kind=detect_kind(text),
        n=n,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        stream=stream,
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        continuous_usage=isinstance(options, dict)
        and bool(options.get("include_usage"))
        and bool(options.get("continuous_usage_stats")),
        logprobs=_chat_logprobs(body) if chat else _completion_logprobs(body),
        response_format=_response_format(body.get("response_format")),
        tool=_tool(body) if chat else None,
        request_id=body["request_id"] if isinstance(body.get("request_id"), str) else None,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _completion_prompts(prompt: Any) -> tuple[list[str], ...]:
    """The tokens of each prompt: a string (after a BOS token), a list of strings, token ids, or
    lists of them."""
    if isinstance(prompt, str):
        return (["<s>", *cache.text_tokens(prompt)],)
    if isinstance(prompt, list) and prompt:
        if all(_is_int(token) for token in prompt):
            return ([str(t) for t in prompt],)
        if all(isinstance(p, str) for p in prompt):
            return tuple(["<s>", *cache.text_tokens(p)] for p in prompt)
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return tuple([str(t) for t in p] for p in prompt)
    raise EngineError("`prompt` must be a string, a list of strings, or token ids.", param="prompt")


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or top < 0):
        raise EngineError(f"`top_logprobs` must be an integer from 0 to {MAX_LOGPROBS}.", param="top_logprobs")
    if top and not body.get("logprobs"):
        raise EngineError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    if not body.get("logprobs"):
        return None
    return _within_max(top or 0)


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    count = body.get("logprobs")
    if count is None:
        return None
    if not _is_int(count) or count < 0:
        raise EngineError(f"`logprobs` must be an integer from 0 to {MAX_LOGPROBS}.", param="logprobs")
    return _within_max(count)


def _within_max(count: int) -> int:
    if count > MAX_LOGPROBS:
        raise EngineError(
            f"Requested sample logprobs of {count}, which is greater than max allowed: {MAX_LOGPROBS}",
            param="logprobs",
        )
    return count


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise EngineError("`response_format` must be an object.", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise not_supported(f"the response format {kind!r} (it produces text, json_object and json_schema)",
                            param="response_format")  # fmt: skip
    if kind == "json_schema" and not isinstance(value.get("json_schema"), dict):
        raise EngineError(
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
            param="response_format",
        )
    try:
        json_answer(value, random.Random(0))  # the schema is one the simulator can answer
    except Unsupported as exc:
        raise not_supported(f"{exc} in a JSON schema (it answers simple schemas)", param="response_format") from exc
    return value


def _tool(body: dict[str, Any]) -> ToolCall | None:
    """Checks `tools` and `tool_choice` as vLLM does; the tool call the model makes, if any."""
    tools = body.get("tools")
    if tools == []:
        raise EngineError(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    if tools is not None and not (
        isinstance(tools, list)
        and all(
            isinstance(t, dict)
            and t.get("type", "function") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            and isinstance(t["function"].get("parameters", {}), dict | None)
            for t in tools
        )
    ):
        raise EngineError("`tools` must be a list of function tools, each with a `name`.", param="tools")
    choice = body.get("tool_choice")
    if choice not in (None, "none"):
        if tools is None:
            raise EngineError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise EngineError(
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
                "are supported.",
                param="tool_choice",
            )
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if not any(t["function"]["name"] == name for t in tools):
                raise EngineError(
                    "The tool specified in `tool_choice` does not match any of the specified `tools`",
                    param="tool_choice",
                )
    try:
        return choose_tool(body)
    except Unsupported as exc:
        raise not_supported(f"{exc} in a tool's parameters (it answers simple schemas)", param="tools") from exc
