"""Requests through the router to real vLLM servers, with the official openai SDK.

What the router sends back must be what the engine would have sent: the same answer, the same
usage, the engine's own errors unchanged; and a stream carries usage only when the client
asked for it (the router asks the engine for it to count tokens, and removes that chunk).
"""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.real.conftest import RealCluster
from tests.real.engines import MODEL

pytestmark = pytest.mark.real

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
IGNORE_EOS = {"ignore_eos": True}  # exactly max_tokens, whatever the random model says


def test_the_models_of_both_engines(cluster: RealCluster) -> None:
    assert [model.id for model in cluster.client().models.list()] == [MODEL]


@pytest.mark.parametrize("pool", ["fast", "team"])
def test_chat_answer_and_usage_are_the_engines_own(cluster: RealCluster, pool: str) -> None:
    engine = cluster.fast if pool == "fast" else cluster.team
    direct = cluster.direct(engine).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, extra_body=IGNORE_EOS
    )
    raw = cluster.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, extra_body=IGNORE_EOS, extra_headers={"X-Route-Pool": pool}
    )
    routed = raw.parse()
    assert (raw.headers["x-route-pool"], raw.headers["x-route-reason"]) == (pool, "pinned")
    assert raw.headers["x-route-backend"] == f"{pool}-1"
    # Greedy decoding of the same prompt on the same engine: the same text, token for token.
    assert routed.choices[0].message.content == direct.choices[0].message.content
    assert routed.choices[0].finish_reason == "length"
    assert routed.usage is not None and direct.usage is not None
    assert routed.usage.completion_tokens == 24
    assert routed.usage.prompt_tokens == direct.usage.prompt_tokens > 0
    assert routed.usage.total_tokens == routed.usage.prompt_tokens + 24


def test_chat_stream_without_usage_has_no_usage_chunk(cluster: RealCluster) -> None:
    stream = cluster.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, stream=True, extra_body=IGNORE_EOS
    )
    chunks = list(stream)
    # The router asked the engine for usage to count tokens; the client did not, so the extra
    # chunk (no choices, only usage) must not reach it.
    assert all(chunk.usage is None for chunk in chunks)
    assert all(chunk.choices for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks)


def test_chat_stream_with_usage_keeps_it(cluster: RealCluster) -> None:
    direct = cluster.direct(cluster.fast).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, extra_body=IGNORE_EOS
    )
    stream = cluster.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Route-Pool": "fast"},
        extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert direct.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (direct.usage.prompt_tokens, 16)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == direct.choices[0].message.content


def test_completions(cluster: RealCluster) -> None:
    answer = cluster.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body=IGNORE_EOS)
    assert answer.usage is not None and answer.usage.completion_tokens == 12 and answer.usage.prompt_tokens > 0
    assert answer.choices[0].text and answer.choices[0].finish_reason == "length"


def test_completions_stream(cluster: RealCluster) -> None:
    stream = cluster.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens > 0
    assert "".join(choice.text for chunk in chunks for choice in chunk.choices)
    # Without include_usage, no chunk carries usage.
    plain = list(cluster.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True))
    assert all(chunk.usage is None and chunk.choices for chunk in plain)


def test_engine_4xx_passes_through_unchanged(cluster: RealCluster) -> None:
    # Longer than the engine's context: vLLM's own 400.
    with pytest.raises(openai.BadRequestError) as direct:
        cluster.direct(cluster.fast).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5000)
    with pytest.raises(openai.BadRequestError) as routed:
        cluster.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5000)
    assert routed.value.status_code == 400
    assert routed.value.body == direct.value.body  # vLLM's own message, type, param and code
    assert routed.value.response.headers["x-route-pool"] == "fast"


def test_engine_404_for_an_unknown_model_passes_through(cluster: RealCluster) -> None:
    with pytest.raises(openai.NotFoundError) as routed:
        cluster.client().chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.NotFoundError) as direct:
        cluster.direct(cluster.fast).chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    assert routed.value.body == direct.value.body


def test_pinning_each_pool(cluster: RealCluster) -> None:
    for pool in ("team", "fast"):
        served, reason, answer = cluster.chat(user="pinner", pool=pool)
        assert (served, reason) == (pool, "pinned")
        assert answer.usage is not None and answer.usage.completion_tokens == 8
    served, reason, _ = cluster.chat(user="idle-user")
    assert (served, reason) == ("fast", "default")  # interactive work on an idle cluster: speculative
