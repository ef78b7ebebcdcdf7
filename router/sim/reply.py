"""A request's answer in vLLM's wire format, from the engine model's per-step token counts.

Streams as vLLM sends them: once the first tokens are out, a role chunk for each choice (chat);
then one chunk per choice and engine step, carrying every token that step produced, the last one
with its `finish_reason`; the usage chunk when `stream_options.include_usage` is set; and
`data: [DONE]`. Whole answers are vLLM's response objects, field for field.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from router.sim.outputs import Logprobs, ToolCall, json_answer, pieces
from router.sim.protocol import Params
from router.sim.runner import EngineRunner, Generation, Update
from router.sim.text import tokens as text_tokens

_NO_LIMIT = 1 << 62

# The fields vLLM sends empty after a choice's finish reason, in its order: by rendering (a
# stream's chunk or a whole answer) and by endpoint (chat or not).
_EMPTY_FIELDS: dict[tuple[str, bool], tuple[str, ...]] = {
    ("stream", False): ("stop_reason", "prompt_token_ids", "token_ids"),
    ("stream", True): ("stop_reason", "token_ids"),
    ("whole", False): ("stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts"),
    ("whole", True): ("stop_reason", "token_ids", "routed_experts"),
}


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one choice says: free text (`fixed` None, the engine model ends it) or a fixed text."""

    fixed: int | None  # tokens of a fixed answer: JSON, or a tool call's name and arguments
    tool: ToolCall | None


class _Choice:
    def __init__(self, index: int, generation: Generation, plan: _Plan, logprobs: Logprobs | None) -> None:
        self.index = index
        self.generation = generation
        self.plan = plan
        self.logprobs = logprobs
        self.text_offset = 0  # completions' logprobs count characters across chunks
        self.delivered = 0  # tokens sent so far (the engine may be ahead)
        self.read = 0  # pieces of the engine's answer taken so far
        self.started = False
        self.header_sent = False  # a tool call's id and name go out with its first token

    def take(self, count: int) -> list[str]:
        taken = self.generation.request.said[self.read : self.read + count]
        self.read += len(taken)
        return taken

    def finish_reason(self) -> str:
        request = self.generation.request
        if self.plan.fixed is None:
            return "length" if request.generated >= request.max_tokens else "stop"
        if request.generated < self.plan.fixed:
            return "length"  # cut off, as a real engine's JSON would be
        return "tool_calls" if self.plan.tool is not None and not self.plan.tool.named else "stop"


class Reply:
    def __init__(
        self,
        params: Params,
        choices: list[_Choice],
        updates: asyncio.Queue[Update],
        *,
        model: str,
        request_id: str,
        on_first_token: Callable[[Generation], None],
        cached_tokens: bool = False,
    ) -> None:
        self.params = params
        self.cached_tokens = cached_tokens
        self.choices = choices
        self.model = model
        self.chat = params.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.created = int(time.time())
        self._updates = updates
        self._on_first_token = on_first_token

    @classmethod
    def submit(
        cls,
        runner: EngineRunner,
        params: Params,
        *,
        model: str,
        request_id: str,
        seed: int,
        on_first_token: Callable[[Generation], None],
        cached_tokens: bool = False,
    ) -> Reply:
        """Put the request's `n` choices (for each prompt) into the engine."""
        updates: asyncio.Queue[Update] = asyncio.Queue()
        choices = []
        for index in range(params.choices):
            plan_rng = random.Random(f"{seed}:{request_id}:{index}")
            source, fixed, tool = _fixed(params, plan_rng)
            limit = params.max_tokens
            if fixed is not None:
                limit = min(fixed, params.max_tokens or _NO_LIMIT)
            generation = runner.submit(
                prompt_tokens=params.prompts[index // params.n],
                max_tokens=limit,
                kind=params.kind,
                ignore_eos=params.ignore_eos or fixed is not None,
                min_tokens=params.min_tokens,
                index=index,
                updates=updates,
                blocks=params.blocks[index // params.n],
                tail=params.tails[index // params.n],
            )
            if source is None:
                source = text_tokens(params.kind, random.Random(f"{seed}:{generation.request.id}"))
            # The engine draws the answer's pieces as it generates them: it caches their blocks.
            generation.request.text = source
            logprobs = None
            if params.logprobs is not None:
                logprobs = Logprobs(random.Random(f"{seed}:{generation.request.id}:logprobs"), params.logprobs)
            choices.append(_Choice(index, generation, _Plan(fixed, tool), logprobs))
        return cls(
            params,
            choices,
            updates,
            model=model,
            request_id=request_id,
            on_first_token=on_first_token,
            cached_tokens=cached_tokens,
        )

    @property
    def generations(self) -> list[Generation]:
        return [choice.generation for choice in self.choices]

    async def _next(self) -> tuple[_Choice, Update]:
        """The next step's tokens for one of the choices (the caller counts the finished ones)."""
        update = await self._updates.get()
        choice = self.choices[update.choice]
        if not choice.started:
            choice.started = True
            self._on_first_token(choice.generation)
        return choice, update

    # -- streams ----------------------------------------------------------------------------

    async def stream(self) -> AsyncIterator[bytes]:
        first = True
        pending = len(self.choices)
        while pending:
            choice, update = await self._next()
            pending -= update.finished
            if first and self.chat:
                for other in self.choices:
                    role = {"role": "assistant", "content": ""}
                    start = {"index": other.index, "delta": role, "logprobs": None, "finish_reason": None}
                    yield self._event([start], **self._running_usage(other))
            first = False
            out = self._stream_choice(choice, update)
            yield (
                self._event([out], **self._running_usage(choice))
                if self.params.continuous_usage
                else self._event([out])
            )
        if self.params.include_usage:
            yield self._event([], usage=self._usage())
        yield b"data: [DONE]\n\n"

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        payload = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        return b"data: " + json.dumps({**payload, **extra}, separators=(",", ":")).encode() + b"\n\n"

    def _running_usage(self, choice: _Choice) -> dict[str, Any]:
        """vLLM's `continuous_usage_stats`: each chunk counts its choice's tokens so far."""
        if not self.params.continuous_usage:
            return {}
        prompt = self.params.prompts[choice.index // self.params.n]
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + choice.delivered,
            "completion_tokens": choice.delivered,
        }
        return {"usage": usage}

    def _stream_choice(self, choice: _Choice, update: Update) -> dict[str, Any]:
        """One choice's part of a chunk."""
        taken = choice.take(update.tokens)
        choice.delivered += update.tokens
        finish_reason = choice.finish_reason() if update.finished else None
        said = {"delta": self._delta(choice, taken)} if self.chat else {"text": "".join(taken)}
        return self._choice(choice, taken, said, finish_reason, "stream")

    def _delta(self, choice: _Choice, taken: list[str]) -> dict[str, Any]:
        tool = choice.plan.tool
        if tool is None:
            return {"content": "".join(taken)}
        # vLLM's tool parsers: the call's id, type and name first, then its arguments in pieces.
        calls: list[dict[str, Any]] = []
        if not choice.header_sent and taken:
            choice.header_sent = True
            taken = taken[1:]
            function = {"name": tool.name}
            header = {"id": _tool_call_id(), "type": "function", "index": 0, "function": function}
            if tool.named:  # a named tool_choice sends its first arguments with the name
                function["arguments"] = "".join(taken)
                return {"tool_calls": [header]}
            calls.append(header)
        if taken:
            calls.append({"index": 0, "function": {"arguments": "".join(taken)}})
        return {"tool_calls": calls} if tool.named else {"content": None, "tool_calls": calls}

    # -- whole answers ----------------------------------------------------------------------

    async def whole(self) -> dict[str, Any]:
        texts: dict[int, list[str]] = {choice.index: [] for choice in self.choices}
        pending = len(self.choices)
        while pending:
            choice, update = await self._next()
            pending -= update.finished
            texts[choice.index].extend(choice.take(update.tokens))
        built = [self._whole_choice(choice, texts[choice.index]) for choice in self.choices]
        answer: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": built,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {"prompt_tokens_details": None, **self._usage(), "completion_tokens_details": None},
        }
        if self.chat:
            answer.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        answer.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return answer

    def _whole_choice(self, choice: _Choice, taken: list[str]) -> dict[str, Any]:
        finish_reason = choice.finish_reason()
        if not self.chat:
            return self._choice(choice, taken, {"text": "".join(taken)}, finish_reason, "whole")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(taken)}
        tool = choice.plan.tool
        if tool is not None and finish_reason != "length":
            function = {"name": tool.name, "arguments": tool.arguments}
            call = {"id": _tool_call_id(), "type": "function", "function": function}
            # A tool the model chose leaves no content; a named one, empty content (vLLM's parsers).
            message["content"] = "" if tool.named else None
            message["tool_calls"] = [call]
        elif tool is not None:
            message["content"] = "".join(taken[1:])  # a cut-off call does not parse: its text is the content
        message.update(refusal=None, annotations=None, audio=None, function_call=None, reasoning=None)
        return self._choice(choice, taken, {"message": message}, finish_reason, "whole")

    # -- one choice, as each rendering shows it ---------------------------------------------

    def _choice(
        self,
        choice: _Choice,
        taken: list[str],
        said: dict[str, Any],
        finish_reason: str | None,
        rendering: Literal["stream", "whole"],
    ) -> dict[str, Any]:
        """What a choice says (its text, delta or message), its log-probabilities of `taken` and
        its finish reason, then the fields vLLM sends empty in this rendering, in vLLM's order."""
        logprobs = self._chat_logprobs(choice, taken) if self.chat else self._completion_logprobs(choice, taken)
        empty = _EMPTY_FIELDS[rendering, self.chat]
        if rendering == "stream" and self.chat and finish_reason is None:
            empty = tuple(name for name in empty if name != "stop_reason")  # only the last chunk has one
        return {
            "index": choice.index,
            **said,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            **dict.fromkeys(empty),
        }

    # -- counts and log-probabilities -------------------------------------------------------

    def _usage(self) -> dict[str, Any]:
        completion = sum(choice.generation.request.generated for choice in self.choices)
        prompt = sum(self.params.prompts)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                 "completion_tokens": completion}  # fmt: skip
        if self.cached_tokens:  # vLLM's --enable-prompt-tokens-details
            cached = sum(choice.generation.request.cached for choice in self.choices[:: self.params.n])
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def _chat_logprobs(self, choice: _Choice, taken: list[str]) -> dict[str, Any] | None:
        if choice.logprobs is None:
            return None
        content = []
        for token in taken:
            logprob, ranked = choice.logprobs.token(token)
            top = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in ranked[: choice.logprobs.top]]
            content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": top})
        return {"content": content}

    def _completion_logprobs(self, choice: _Choice, taken: list[str]) -> dict[str, Any] | None:
        if choice.logprobs is None:
            return None
        out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token in taken:
            logprob, ranked = choice.logprobs.token(token)
            out["text_offset"].append(choice.text_offset)
            out["token_logprobs"].append(logprob)
            out["tokens"].append(token)
            out["top_logprobs"].append(dict(ranked[: choice.logprobs.top + 1]))
            choice.text_offset += len(token)
        return out


def _fixed(params: Params, rng: random.Random) -> tuple[Iterator[str] | None, int | None, ToolCall | None]:
    """A tool call's or a JSON answer's pieces and length; (None, None, None) for free text."""
    if params.tool is not None:
        # The name stands for the tokens of the call's markup; the arguments follow.
        cut = [params.tool.name, *pieces(params.tool.arguments)]
        return iter(cut), len(cut), params.tool
    if params.response_format is not None:
        cut = pieces(json_answer(params.response_format, rng))
        return iter(cut), len(cut), None
    return None, None, None


def _tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"
