"""Stored responses across client keys (router.responses.stage): a response made through the
router answers only the key that made it. The engine is sent the backend's key (or none), so it
cannot tell clients apart; the router can, for the ids it remembers."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import openai
import pytest

from tests.conftest import Cluster

pytestmark = pytest.mark.e2e  # a router and fake engines on loopback

MODEL = "test-model"


def test_a_stored_response_is_not_found_for_another_key(
    make_cluster: Callable[..., AbstractContextManager[Cluster]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("H30_CLIENT_KEYS", "key-a,key-b")
    with make_cluster(auth={"client_keys_env": "H30_CLIENT_KEYS"}, routing={"mode": "static"}) as cluster:
        a, b = cluster.client("key-a"), cluster.client("key-b")
        made = a.responses.create(model=MODEL, input="a secret of A's")
        sent = len(cluster.fast.requests) + len(cluster.team.requests)

        # Read, continued or deleted by another key: OpenAI's 404, and nothing reaches an engine.
        for attempt in (
            lambda: b.responses.retrieve(made.id),
            lambda: b.responses.create(model=MODEL, input="more", previous_response_id=made.id),
            lambda: b.responses.delete(made.id),
        ):
            with pytest.raises(openai.NotFoundError) as caught:
                attempt()
            assert caught.value.body == {
                "message": f"Response with id '{made.id}' not found.",
                "type": "invalid_request_error",
                "param": None,
                "code": "response_not_found",
            }
        assert len(cluster.fast.requests) + len(cluster.team.requests) == sent
        assert made.id in cluster.fast.stored

        # Its own key reads it, continues it, deletes it.
        assert a.responses.retrieve(made.id).id == made.id
        follow = a.responses.create(model=MODEL, input="more", previous_response_id=made.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(follow.id)
        a.responses.delete(made.id)
        assert made.id not in cluster.fast.stored
