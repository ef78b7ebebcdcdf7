"""What the demo engine answers beyond plain text, through the router, read by the official client:
n > 1, tool calls, JSON answers, log-probabilities, embeddings, request ids, and a clear refusal
of what it does not model."""

from __future__ import annotations

import base64
import json
import math
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion_message_function_tool_call import Function
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.config import Settings
from router.sim.profile import load_profile
from router.sim.server import create_sim_app
from tests.servers import ServerThread
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of two simulated engines

MODEL = "glm-5.3-flash"
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK: Any = {
    "type": "function",
    "function": {"name": "current_time", "parameters": {"type": "object", "properties": {}}},
}


@dataclass
class Stack:
    router: ServerThread
    fast: ServerThread
    team: ServerThread
    registry: CollectorRegistry

    sdk: openai.OpenAI

    def client(self) -> openai.OpenAI:
        return self.sdk

    def idle(self) -> None:
        """Nothing left in flight in the router, nor running in the engines."""

        def router_idle() -> bool:
            samples = [
                self.registry.get_sample_value("specroute_in_flight_requests", {"pool": pool, "backend": backend})
                for pool, backend in (("fast", "fast-1"), ("team", "team-1"))
            ]
            return all(not value for value in samples)

        wait_until(router_idle, message="nothing in flight in the router")
        engines = (self.fast.app.state.runner.engine, self.team.app.state.runner.engine)
        wait_until(lambda: not any(engine.busy for engine in engines), message="the engines idle")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with (
        ServerThread(create_sim_app(load_profile("fast"), time_scale=50)) as fast,
        ServerThread(create_sim_app(load_profile("team"), time_scale=50)) as team,
        tempfile.TemporaryDirectory(prefix="specroute-batches-") as store,
    ):
        data: dict[str, Any] = {
            "pools": {
                "fast": {"speculative": True, "backends": {"fast-1": {"url": fast.url, "max_concurrency": 64}}},
                "team": {"speculative": False, "backends": {"team-1": {"url": team.url, "max_concurrency": 64}}},
            },
            "batch": {"store_dir": store},
        }
        registry = CollectorRegistry()
        with (
            ServerThread(create_app(Settings(**data), registry=registry), fast=True) as router,
            openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0) as sdk,
        ):
            yield Stack(router, fast, team, registry, sdk)


def _ask(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def _calls(answer: ChatCompletion) -> list[Function]:
    """The functions called in an answer's first choice."""
    calls = answer.choices[0].message.tool_calls or []
    assert all(isinstance(call, ChatCompletionMessageFunctionToolCall) for call in calls)
    return [call.function for call in calls if isinstance(call, ChatCompletionMessageFunctionToolCall)]


def _with_choices(chunks: list[Any]) -> list[Any]:
    """The chunks of a stream that carry a choice (not the usage chunk)."""
    return [chunk for chunk in chunks if chunk.choices]


# -- n > 1 -------------------------------------------------------------------------------------


def test_n_choices_whole_and_streamed(stack: Stack) -> None:
    client = stack.client()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_ask("Tell me about tides."), n=3, max_tokens=12, extra_body={"ignore_eos": True}
    )
    whole = raw.parse()
    assert raw.headers["x-route-reason"] == "n>1"
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.content for c in whole.choices)
    assert len({c.message.content for c in whole.choices}) > 1  # n answers, not one copied
    assert whole.usage is not None and whole.usage.completion_tokens == 3 * 12

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=_ask("Tell me about tides."),
            n=2,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]  # vLLM: a role chunk for each choice, one choice per chunk
    assert all(len(c.choices) == 1 for c in chunks if c.choices)
    finishes = {
        c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    }
    assert finishes == {0: "length", 1: "length"}
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)}  # fmt: skip
    assert all(len(text.split()) >= 10 for text in texts.values())
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 2 * 20


def test_completions_number_choices_per_prompt(stack: Stack) -> None:
    completion = stack.client().completions.create(
        model=MODEL, prompt=["The sea", "Old maps"], n=2, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]  # vLLM: prompt * n + choice
    assert completion.usage is not None and completion.usage.completion_tokens == 4 * 5
    assert completion.usage.prompt_tokens == 2 * 3  # each prompt counted once, not once a choice


# -- tools -------------------------------------------------------------------------------------


def test_a_tool_call_when_the_prompt_asks_for_one(stack: Stack) -> None:
    client = stack.client()
    answer = client.chat.completions.create(
        model=MODEL, messages=_ask("What is the weather in Lisbon? Use get_weather."), tools=[CLOCK, WEATHER]
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert arguments["city"] == "Lisbon"  # a name from the prompt, where a string is wanted

    # The tool's result comes back: now the model answers in text.
    conversation: list[Any] = [
        *_ask("What is the weather in Lisbon? Use get_weather."),
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    follow = client.chat.completions.create(
        model=MODEL,
        messages=conversation,
        tools=[WEATHER],
        max_tokens=16,
    )
    assert follow.choices[0].message.tool_calls is None and follow.choices[0].message.content
    assert follow.choices[0].finish_reason in ("stop", "length")

    plain = client.chat.completions.create(model=MODEL, messages=_ask("Tell me about tides."), tools=[WEATHER])
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason != "tool_calls"
    none = client.chat.completions.create(
        model=MODEL, messages=_ask("Use get_weather for Oslo."), tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None


def test_named_and_required_tool_choice(stack: Stack) -> None:
    client = stack.client()
    named = client.chat.completions.create(
        model=MODEL,
        messages=_ask("Tell me about tides."),
        tools=[CLOCK, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    # OpenAI's (and vLLM's) rule: a named tool finishes with "stop", a chosen one with "tool_calls".
    assert named.choices[0].finish_reason == "stop"
    assert [c.name for c in _calls(named)] == ["get_weather"]
    required = client.chat.completions.create(
        model=MODEL, messages=_ask("Tell me about tides."), tools=[CLOCK], tool_choice="required"
    )
    assert required.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.arguments) for c in _calls(required)] == [{}]


def test_a_streamed_tool_call_in_vllm_deltas(stack: Stack) -> None:
    chunks = list(
        stack.client().chat.completions.create(
            model=MODEL, messages=_ask("Call get_weather for Lisbon, please."), tools=[WEATHER], stream=True
        )
    )
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    # First the call's id, type and name (no arguments), then the arguments piece by piece.
    header, *rest = deltas
    assert header.id and header.id.startswith("chatcmpl-tool-") and header.type == "function"
    assert header.function is not None and header.function.name == "get_weather"
    assert header.function.arguments is None
    assert rest and all(d.id is None and d.function is not None and d.function.name is None for d in rest)
    assert all(d.index == 0 for d in deltas)
    arguments = "".join(d.function.arguments or "" for d in rest if d.function)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # The SDK's own accumulation of the deltas gives the same call.
    with stack.client().chat.completions.stream(
        model=MODEL, messages=_ask("Call get_weather for Lisbon, please."), tools=[WEATHER]
    ) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Lisbon"


def test_a_tool_call_cut_by_max_tokens_is_length(stack: Stack) -> None:
    answer = stack.client().chat.completions.create(
        model=MODEL, messages=_ask("Use get_weather for Lisbon."), tools=[WEATHER], max_tokens=3
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 3


# -- JSON --------------------------------------------------------------------------------------


def test_json_object_answers_json(stack: Stack) -> None:
    client = stack.client()
    answer = client.chat.completions.create(
        model=MODEL, messages=_ask("Summarise the tides."), response_format={"type": "json_object"}
    )
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)
    streamed = client.chat.completions.create(
        model=MODEL, messages=_ask("Summarise the tides."), response_format={"type": "json_object"}, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert isinstance(json.loads(text), dict)


class Harbour(pydantic.BaseModel):
    name: str
    depth_m: float
    open: bool
    berths: list[int]
    kind: Literal["fishing", "ferry"]


class Town(pydantic.BaseModel):
    town: str
    harbours: list[Harbour]
    founded: int | None


def test_json_schema_answers_match_the_schema(stack: Stack) -> None:
    # The SDK sends the model's strict schema ($defs, $ref, anyOf with null) and validates the answer.
    parsed = stack.client().chat.completions.parse(
        model=MODEL, messages=_ask("Describe a harbour town."), response_format=Town
    )
    town = parsed.choices[0].message.parsed
    assert isinstance(town, Town) and town.harbours and town.harbours[0].kind == "fishing"


def test_a_schema_it_cannot_answer_is_refused_clearly(stack: Stack) -> None:
    schema: Any = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        stack.client().chat.completions.create(
            model=MODEL,
            messages=_ask("A code."),
            response_format={"type": "json_schema", "json_schema": {"name": "code", "schema": schema}},
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert "simulator does not support" in error["message"] and "'pattern'" in error["message"]
    assert error["param"] == "response_format" and error["type"] == "BadRequestError"


# -- log-probabilities -------------------------------------------------------------------------


def test_chat_logprobs_whole_and_streamed(stack: Stack) -> None:
    client = stack.client()
    answer = client.chat.completions.create(
        model=MODEL, messages=_ask("Tell me about tides."), max_tokens=16, logprobs=True, top_logprobs=3
    )
    choice = answer.choices[0]
    content = choice.logprobs.content if choice.logprobs else None
    assert content is not None and answer.usage is not None
    assert len(content) == answer.usage.completion_tokens
    assert "".join(item.token for item in content) == choice.message.content
    for item in content:
        assert item.logprob <= 0 and item.bytes == list(item.token.encode())
        top = [t.logprob for t in item.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and all(lp <= 0 for lp in top)
        assert item.top_logprobs[0].token == item.token  # the sampled token is the likeliest
        assert sum(math.exp(lp) for lp in top) <= 1 + 1e-9  # probabilities, not just numbers
    without_top = client.chat.completions.create(
        model=MODEL, messages=_ask("Tell me about tides."), max_tokens=4, logprobs=True
    )
    assert without_top.choices[0].logprobs and all(
        item.top_logprobs == [] for item in without_top.choices[0].logprobs.content or []
    )

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=_ask("Tell me about tides."), max_tokens=16, logprobs=True, top_logprobs=2,
            stream=True, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    tokens = [
        item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content or []
    ]
    assert len(tokens) == 16
    assert "".join(t.token for t in tokens) == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert not client.chat.completions.create(model=MODEL, messages=_ask("Hi"), max_tokens=2).choices[0].logprobs


def test_completion_logprobs_in_vllm_shape(stack: Stack) -> None:
    client = stack.client()
    completion = client.completions.create(model=MODEL, prompt="The sea", max_tokens=10, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.text_offset and logprobs.top_logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == offsets
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs or [])
    assert all(
        len(top) == 2 and token in top for top, token in zip(logprobs.top_logprobs, logprobs.tokens, strict=True)
    )

    # Streamed, the offsets run on from chunk to chunk.
    streamed = list(client.completions.create(model=MODEL, prompt="The sea", max_tokens=12, logprobs=0, stream=True))
    offsets_seen = [
        o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset or []
    ]
    tokens_seen = [
        t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []
    ]
    assert offsets_seen == [sum(len(t) for t in tokens_seen[:i]) for i in range(len(tokens_seen))]


# -- embeddings --------------------------------------------------------------------------------


def test_embeddings_of_the_configured_size(stack: Stack) -> None:
    client = stack.client()
    texts = ["the tide comes in", "the tide goes out", "a recipe for bread"]
    # The SDK asks for base64 unless told otherwise, and decodes it.
    result = client.embeddings.create(model=MODEL, input=texts)
    vectors = [item.embedding for item in result.data]
    assert [item.index for item in result.data] == [0, 1, 2]
    assert all(len(v) == load_profile("fast").embedding_size for v in vectors)
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-5) for v in vectors)

    def cosine(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])  # shared words, nearer
    again = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    assert again.data[0].embedding == pytest.approx(vectors[0], abs=1e-6)  # float32 over the wire
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0
    short = client.embeddings.create(model=MODEL, input=[[101, 102, 103]], dimensions=8)
    assert len(short.data[0].embedding) == 8 and short.usage.prompt_tokens == 3


def test_embedding_size_is_a_setting() -> None:
    with ServerThread(create_sim_app(load_profile("team"), embedding_size=16)) as engine:
        body = httpx.post(
            engine.url + "/v1/embeddings", json={"model": MODEL, "input": "tides", "encoding_format": "base64"}
        ).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert len(struct.unpack("<16f", raw)) == 16
    assert body["id"].startswith("embd-") and body["object"] == "list"


# -- request ids -------------------------------------------------------------------------------


def test_the_request_id_is_the_base_of_the_answer_id(stack: Stack) -> None:
    client = stack.client()
    given = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_ask("Hi"), max_tokens=2, extra_headers={"X-Request-Id": "trace-42"}
    )
    assert given.headers["x-request-id"] == "trace-42"
    assert given.parse().id == "chatcmpl-trace-42"
    # Without one the router makes one, forwards it, and the engine builds on it.
    made = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert made.parse().id == "cmpl-" + made.headers["x-request-id"]
    streamed = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_ask("Hi"), max_tokens=2, stream=True, extra_headers={"X-Request-Id": "trace-43"}
    )
    assert {chunk.id for chunk in streamed.parse()} == {"chatcmpl-trace-43"}
    embedded = client.embeddings.with_raw_response.create(
        model=MODEL, input="Hi", extra_headers={"X-Request-Id": "trace-44"}
    )
    assert embedded.http_response.json()["id"] == "embd-trace-44"


def test_the_engine_echoes_x_request_id_on_every_answer(stack: Stack) -> None:
    engine = stack.fast.url
    for method, path, body in (
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": _ask("Hi"), "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"model": "nope", "messages": _ask("Hi")}),
        ("GET", "/v1/models", None),
        ("GET", "/health", None),
        ("GET", "/metrics", None),
        ("POST", "/v1/responses", {"model": MODEL, "input": "Hi"}),
    ):
        echoed = httpx.request(method, engine + path, json=body, headers={"X-Request-Id": "abc-1"})
        assert echoed.headers.get_list("x-request-id") == ["abc-1"], path
        made = httpx.request(method, engine + path, json=body)
        assert len(made.headers["x-request-id"]) == 32, path  # vLLM: a new uuid4, in hex
    answer = httpx.post(engine + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    # Without the header vLLM takes the body's `request_id` or a new one, apart from the header's.
    assert answer.json()["id"].startswith("cmpl-") and len(answer.json()["id"]) == 5 + 32
    body_id = httpx.post(
        engine + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "request_id": "mine"}
    )
    assert body_id.json()["id"] == "cmpl-mine"


# -- what it does not model --------------------------------------------------------------------


def test_what_it_does_not_model_is_an_openai_error_that_says_so(stack: Stack) -> None:
    client = stack.client()
    with pytest.raises(openai.NotFoundError) as endpoint:
        client.responses.create(model=MODEL, input="Hi")
    body = endpoint.value.body
    assert isinstance(body, dict) and "simulator does not support POST /v1/responses" in body["message"]
    assert set(body) == {"message", "type", "param", "code"}
    for extra, param in (
        ({"use_beam_search": True}, "use_beam_search"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format"),
        ({"modalities": ["text", "audio"]}, "modalities"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=_ask("Hi"), max_tokens=2, extra_body=extra)
        error = caught.value.body
        assert isinstance(error, dict) and "simulator does not support" in error["message"], extra
        assert error["param"] == param and error["code"] == 400
    with pytest.raises(openai.BadRequestError, match="echoing the prompt"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, echo=True)
    stack.idle()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": "3"}, "n"),
        ({"n": 10_000}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tools": "get_weather"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "http://a/b"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"$ref": "#", "type": "object"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "array", "minItems": 10**9}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 10**9}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "a"}}}},
         "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "quantum"}}}],
          "tool_choice": "required"}, "tools"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        *(({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
           "response_format")
          for schema in ({"anyOf": 5}, {"type": "object", "properties": [1]}, {"type": "array", "minItems": "a"},
                         {"type": "array", "minItems": 3, "maxItems": 1}, {"type": "string", "format": "ipv9"})),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                   "properties": "x"}}}],
          "tool_choice": "required"}, "tools"),
    ],
)  # fmt: skip
def test_hostile_bodies_get_a_400_and_start_nothing(stack: Stack, body: dict[str, Any], param: str) -> None:
    engine = stack.fast.app.state.runner.engine
    before = engine.counters.finished + engine.counters.aborted + len(engine.running) + len(engine.waiting)
    payload = {"model": MODEL, "messages": _ask("Use get_weather for Lisbon."), "max_tokens": 4, **body}
    # Straight to the engine (the router checks bodies itself, and would pass these on).
    response = httpx.post(stack.fast.url + "/v1/chat/completions", json=payload)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError"
    after = engine.counters.finished + engine.counters.aborted + len(engine.running) + len(engine.waiting)
    assert after == before  # nothing reached the engine model

    # Through the router: the same error, the gauges back at zero, the next request served.
    with pytest.raises(openai.BadRequestError):
        stack.client().chat.completions.create(**payload)
    stack.idle()
    assert stack.client().chat.completions.create(model=MODEL, messages=_ask("Hi"), max_tokens=2).choices


def test_a_schema_nested_past_the_limit_is_refused(stack: Stack) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"a": schema}}
    response_format = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    payload = {"model": MODEL, "messages": _ask("Hi"), "response_format": response_format}
    response = httpx.post(stack.fast.url + "/v1/chat/completions", json=payload)
    assert response.status_code == 400 and "deeper than" in response.json()["error"]["message"]
    # A reference to itself ends in the same limit, not in a recursion error.
    looped = {"type": "object", "properties": {"self": {"$ref": "#"}}}
    payload["response_format"] = {"type": "json_schema", "json_schema": {"name": "loop", "schema": looped}}
    response = httpx.post(stack.fast.url + "/v1/chat/completions", json=payload)
    assert response.status_code == 400 and "deeper than" in response.json()["error"]["message"]


def test_odd_types_never_break_the_engine(stack: Stack) -> None:
    """Fields of the wrong type are refused or have no effect: never a 500, never a stuck engine."""
    odd: list[dict[str, Any]] = [
        {"modalities": 5}, {"modalities": "audio"}, {"logprobs": "yes"}, {"top_logprobs": -1}, {"n": 1.0},
        {"n": None}, {"tools": [{"function": {"name": "f", "parameters": None}}]}, {"tool_choice": {"function": "x"}},
        {"tools": [WEATHER], "tool_choice": {"type": "function"}}, {"response_format": {"type": None}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
        {"messages": [{"role": "user", "content": 5}, "text", None]}, {"stream_options": "x", "stream": True},
        {"max_tokens": True}, {"min_tokens": "3"}, {"request_id": 7}, {"echo": None}, {"best_of": 2},
    ]  # fmt: skip
    for extra in odd:
        payload = {"model": MODEL, "messages": _ask("Hi"), "max_tokens": 2, **extra}
        response = httpx.post(stack.fast.url + "/v1/chat/completions", json=payload)
        assert response.status_code in (200, 400), (extra, response.text)
        if response.status_code == 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    completions: list[Any] = [{"prompt": [1, True]}, {"prompt": [[]]}, {"prompt": {"a": 1}}, {"logprobs": 21},
                              {"logprobs": -1}, {"suffix": "x"}, {"prompt": [[1, 2], [3]], "n": 2}]  # fmt: skip
    for extra in completions:
        payload = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **extra}
        response = httpx.post(stack.fast.url + "/v1/completions", json=payload)
        assert response.status_code in (200, 400), (extra, response.text)
    stack.idle()


@pytest.mark.parametrize(
    "body",
    [
        {"input": []},
        {"input": [1, "a"]},
        {"input": [[]]},
        {"input": [True]},
        {"input": None},
        {"input": ["x"] * 2049},
        {"input": "x", "dimensions": 0},
        {"input": "x", "dimensions": 10**9},
        {"input": "x", "encoding_format": "bytes"},
        {"input": "x", "model": "nope"},
    ],
)
def test_hostile_embedding_bodies_get_an_error(stack: Stack, body: dict[str, Any]) -> None:
    response = httpx.post(stack.fast.url + "/v1/embeddings", json={"model": MODEL, **body})
    assert response.status_code in (400, 404), response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(stack.fast.url + "/v1/embeddings", json={"model": MODEL, "input": "x"}).status_code == 200


# -- requests as the load tools and libraries send them ----------------------------------------
# Captured from guidellm 0.8.1, aiperf 0.13.0, inference-perf 0.7.0 and langchain-openai 1.7.4
# run against `specroute serve` (docs/compatibility.md); the prompts are shortened.

GUIDELLM = {"user-agent": "python-httpx/0.28.1"}
AIPERF = {"user-agent": "aiperf/0.13.0"}
INFERENCE_PERF = {"user-agent": "Python/3.11 aiohttp/3.14.5"}
LANGCHAIN = {"user-agent": "OpenAI/Python 3.57.0"}
TOOL_REQUESTS: list[tuple[str, dict[str, str], str, dict[str, Any]]] = [
    ("guidellm chat stream", GUIDELLM, "/v1/chat/completions",
     {"model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
      "max_completion_tokens": 16, "ignore_eos": True,
      "messages": [{"role": "user", "content": [{"type": "text", "text": "1 0 m0 Finish medical want almost away"}]}]}),
    ("aiperf chat", AIPERF, "/v1/chat/completions",
     {"messages": [{"role": "user", "content": " his time Hath founded his good fortunes"}], "model": MODEL,
      "stream": False}),
    ("aiperf chat stream", AIPERF, "/v1/chat/completions",
     {"messages": [{"role": "user", "content": " is this which stains The stony entrance"}], "model": MODEL,
      "stream": True, "stream_options": {"include_usage": True}}),
    ("inference-perf completions", INFERENCE_PERF, "/v1/completions",
     {"model": MODEL, "prompt": "1 2 3 1", "max_tokens": 30, "ignore_eos": True, "stream": False}),
    ("inference-perf chat stream", INFERENCE_PERF, "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "mock prompt 1"}], "max_tokens": 30,
      "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
    ("langchain OpenAI completions", LANGCHAIN, "/v1/completions",
     {"model": MODEL, "prompt": ["The sea"], "frequency_penalty": 0, "logprobs": None, "max_tokens": 256, "n": 1,
      "presence_penalty": 0, "seed": None, "temperature": 0.7, "top_p": 1}),
    ("langchain structured output (function calling)", LANGCHAIN, "/v1/chat/completions",
     {"model": MODEL, "stream": False, "messages": [{"content": "Describe a harbour.", "role": "user"}],
      "parallel_tool_calls": False, "tool_choice": {"type": "function", "function": {"name": "Harbour"}},
      "tools": [{"type": "function", "function": {"name": "Harbour", "description": "", "parameters": {
          "properties": {"name": {"type": "string"}, "depth_m": {"type": "number"}},
          "required": ["name", "depth_m"], "type": "object"}}}]}),
    ("langchain embeddings", LANGCHAIN, "/v1/embeddings",
     {"model": MODEL, "input": ["tides", "maps"], "encoding_format": "base64"}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "headers", "path", "body"), TOOL_REQUESTS, ids=[r[0] for r in TOOL_REQUESTS])
def test_requests_as_the_tools_send_them(
    stack: Stack, name: str, headers: dict[str, str], path: str, body: dict[str, Any]
) -> None:
    response = httpx.post(stack.router.url + path, json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"]
    if not body.get("stream"):
        answer = response.json()
        assert answer["usage"]["prompt_tokens"] > 0
        if "choices" in answer:
            assert answer["choices"] and answer["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
        return
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    if body["stream_options"].get("continuous_usage_stats"):
        # vLLM's running count on every chunk, which guidellm reads token by token.
        counts = [event["usage"]["completion_tokens"] for event in events[:-1]]
        assert counts == sorted(counts) and counts[0] == 0
        assert counts[-1] == events[-1]["usage"]["completion_tokens"] == body["max_completion_tokens"]


def test_the_probes_the_tools_make(stack: Stack) -> None:
    # guidellm: GET /health, then /v1/models; aiperf: HEAD and GET /metrics.
    assert httpx.get(stack.router.url + "/health", headers=GUIDELLM).status_code == 200
    assert [m["id"] for m in httpx.get(stack.router.url + "/v1/models", headers=GUIDELLM).json()["data"]] == [MODEL]
    assert httpx.head(stack.router.url + "/metrics", headers=INFERENCE_PERF).status_code == 200
    assert "specroute_requests_total" in httpx.get(stack.router.url + "/metrics").text
