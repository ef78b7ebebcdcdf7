"""Pure routing policy: a classified request and a snapshot of the pools -> a pool, with the reason.

Batch work goes to the standard pool. Interactive work goes where its user is served best:
first token within `ttft_target`, then the higher speed. The speculative pool is the default
place; interactive work leaves it

- when it would wait there: the speculative engine has requests waiting (seen on two scrapes
  and while it has no room of its own), its KV cache is past the threshold once this request is
  placed, or the router's own slots for it are full (`spill:spec-queueing`, `spill:spec-kv-full`,
  `spill:spec-full`) — but only for a standard pool whose predicted first token comes sooner
  than on the speculative one (or that does not queue at all); nor where it cannot go
  (`spill:spec-down`, `spill:spec-draining`);
- otherwise only for a standard pool that does not queue and whose predicted first token is
  within the target: where the prompts queued on the speculative pool for their prefill put its
  first token past the target and the standard pool's comes sooner, `min_gain` sooner where it
  runs batch work (conversations priced, `spill:spec-prefill`), or where it is the faster place:
  - `crossover` mode: past the configured crossover concurrency for the content kind, unless
    the standard pool carries even more (`spill:past-crossover`);
  - `adaptive` mode: when the standard pool's learned per-user speed is higher beyond the noise
    of both (their 95 % intervals apart; `spill:faster-on-standard`); before anything is learned
    with confidence the pools' prior speeds stand in where configured (router.learn); without
    them, or when the difference is within the noise, as in `crossover`.

A pool queues when its engines have requests waiting, its emptiest engine's KV cache is past the
threshold, or it has no free router slot or a non-empty router queue. So interactive work never
moves onto a queueing pool while the speculative pool has free slots and KV headroom.

`static` mode does none of this: interactive to the speculative pool, batch to the standard one
(interactive work still leaves a speculative pool that is down or drained).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from router.config import Conversations, JobClass, Routing
from router.content import ContentKind
from router.routing.classify import Classification
from router.routing.learn import Estimate


@dataclass(frozen=True, slots=True)
class PoolState:
    """What the policy knows of one pool at the moment of a decision."""

    speculative: bool
    healthy: bool = True  # has a backend that takes new work
    draining: bool = False  # ...and has none because an operator is draining them
    # Requests on its least-loaded healthy backend: the router's own or the engine's, the larger.
    concurrency: int = 0
    has_room: bool = True  # a backend below max_concurrency and nobody in the router's queue
    # Waiting inside its engines on two scrapes running, while the engine had no room of its own
    # (fresh readings only): a queue, not a request caught between arrival and the next step.
    engine_queued: float = 0.0
    # KV usage of its emptiest engine once this request is sent (projected from fresh scrapes).
    kv_usage: float | None = None
    # Predicted wait for a first token there, seconds (None: nothing to go on).
    ttft: float | None = None
    # Predicted per-user tok/s for one more request, by content (adaptive mode; None: not learned).
    speed: Mapping[ContentKind, Estimate | None] = field(default_factory=dict)
    # The request's conversation (router.conversations): the backend here most likely holding the
    # longest prefix of its prompt, within the load bound (else the one its first token is predicted
    # soonest on), and the prompt tokens it holds.
    prefer: str | None = None
    held: int = 0
    home: bool = False  # the conversation was last placed in this pool...
    settled: bool = False  # ...having moved here lately
    # Of `ttft`, the prefill queued on its backend and this prompt's own (conversations priced).
    prefill: float = 0.0
    batch: bool = False  # that backend runs batch work (conversations priced)


@dataclass(frozen=True, slots=True)
class Decision:
    pool: str
    job: JobClass
    reason: str
    content: ContentKind = "prose"
    # The first-token wait predicted for the pool when it was chosen, seconds (None: not known);
    # set against the actual one once it arrives (router.request.observe).
    predicted_ttft: float | None = None
    # Every pool's predicted first token at the decision (`X-Route-Predicted-TTFT`).
    predictions: tuple[tuple[str, float], ...] = ()


class Policy:
    def __init__(
        self,
        routing: Routing,
        *,
        interactive_pool: str,
        batch_pool: str,
        conversations: Conversations | None = None,
    ) -> None:
        self._config = routing
        self._conversations = conversations or Conversations()
        self._speculative = interactive_pool
        self._standard = batch_pool

    def decide(
        self,
        classification: Classification,
        content: ContentKind,
        pools: Mapping[str, PoolState],
        *,
        ttft_target: float | None = None,
    ) -> Decision:
        """`ttft_target`: the request's own first-token target (`X-SLO-TTFT-MS`), seconds."""
        target = ttft_target if ttft_target is not None else self._config.ttft_target
        decision = self._decide(classification, content, pools, target)
        if ttft_target is None or decision.job != "interactive" or decision.reason == "pinned":
            return decision
        return self._within(decision, pools, ttft_target)

    def _within(self, decision: Decision, pools: Mapping[str, PoolState], target: float) -> Decision:
        """A request with a first-token target of its own: where its first token is predicted
        within it, the decided pool first; if nowhere, where it comes soonest (`slo:unmet`, which
        the router answers with 503 instead when `routing.reject_unmeetable_ttft`)."""
        if _within(pools[decision.pool], target):
            return decision
        others = [
            name
            for name in dict.fromkeys((self._speculative, self._standard))
            if name != decision.pool and self._unavailable(pools[name]) is None
        ]
        for name in others:
            if _within(pools[name], target):
                return replace(decision, pool=name, reason="slo:ttft")
        soonest = min([decision.pool, *others], key=lambda name: pools[name].ttft or 0.0)
        return replace(decision, pool=soonest, reason="slo:unmet")

    def _decide(
        self, classification: Classification, content: ContentKind, pools: Mapping[str, PoolState], target: float
    ) -> Decision:
        job = classification.job
        predictions = tuple((name, state.ttft) for name, state in pools.items() if state.ttft is not None)

        def to(pool: str, reason: str = classification.reason) -> Decision:
            state = pools.get(pool)
            return Decision(pool, job, reason, content, state.ttft if state is not None else None, predictions)

        if classification.pinned_pool is not None:
            return to(classification.pinned_pool, "pinned")
        if self._speculative == self._standard:
            return to(self._standard)

        spec, std = pools[self._speculative], pools[self._standard]
        if job == "batch":
            standard_unavailable = not std.healthy or not std.has_room
            spec_idle = self._wait(spec) is None and spec.concurrency < self._config.crossover[content]
            if standard_unavailable and spec_idle and self._config.batch_may_use_speculative:
                return to(self._speculative, "borrow:standard-unavailable")
            return to(self._standard)

        unavailable = self._unavailable(spec)
        standard_open = std.healthy and std.has_room
        if unavailable is not None:
            return to(self._standard, f"spill:spec-{unavailable}") if standard_open else to(self._speculative)
        if self._config.mode == "static" or not standard_open:
            return to(self._speculative)
        kept = self._conversation(spec, std, content, target)
        if kept is not None:
            pool, reason = kept
            return to(pool, reason or classification.reason)
        waits = self._wait(spec)
        if waits is not None:
            # Spill only to where the first token comes sooner.
            if self._wait(std) is None or _sooner(std.ttft, spec.ttft):
                return to(self._standard, f"spill:spec-{waits}")
            return to(self._speculative)
        # The speculative pool has room: leave it only for a standard pool that neither queues
        # nor keeps its first tokens past the target, and only for a faster place...
        if self._wait(std) is not None or (std.ttft is not None and std.ttft > target):
            return to(self._speculative)
        # ...or, where the prompts queued for their prefill there (and its own) are what makes
        # its first token late, for the standard pool's sooner one (a long conversation comes
        # back when the standard pool is no longer the faster place: `_conversation`); only
        # `min_gain` sooner where that runs batch work, which its answer, attending to the whole
        # prompt at every step, slows.
        late = spec.ttft is not None and spec.ttft - spec.prefill <= target < spec.ttft
        gain = self._conversations.min_gain if std.batch else 0.0
        if late and spec.ttft is not None and _sooner(std.ttft, spec.ttft * (1 - gain)):
            return to(self._standard, "spill:spec-prefill")
        spec_speed, std_speed = spec.speed.get(content), std.speed.get(content)
        if self._config.mode == "adaptive" and spec_speed is not None and std_speed is not None:
            if std_speed.low > spec_speed.high:
                return to(self._standard, "spill:faster-on-standard")
            if spec_speed.low > std_speed.high:
                return to(self._speculative)
            # Within the noise of what was learned: the configured crossover decides.
        # Past the crossover the standard pool is faster at the same load, and the more so the
        # fewer it serves; with more on it than on the speculative pool, it is not.
        if spec.concurrency + 1 > self._config.crossover[content] and std.concurrency <= spec.concurrency:
            return to(self._standard, "spill:past-crossover")
        return to(self._speculative)

    def _conversation(
        self, spec: PoolState, std: PoolState, content: ContentKind, target: float
    ) -> tuple[str, str | None] | None:
        """Where a long conversation goes: the pool holding its cache, unless its first token
        there is predicted past the target and the other pool's, its prefill counted, comes
        `min_gain` sooner, or the standard pool holds it and runs batch work there or is no longer
        the faster place while the speculative pool takes it at once, its whole prefill counted,
        within the target; and not again soon after a move.
        None: not a long conversation (decided as any other request, its prefill counted in the
        predicted first tokens)."""
        config = self._conversations
        at_spec = spec.home and spec.held >= config.long_tokens
        if not (at_spec or (std.home and std.held >= config.long_tokens)):
            return None
        home, here, other, there = (
            (self._speculative, spec, self._standard, std)
            if at_spec
            else (self._standard, std, self._speculative, spec)
        )
        stay = None if home == self._speculative else "conversation:cached"
        if here.settled or self._unavailable(there) is not None:
            return home, stay
        back = home == self._standard and self._wait(there) is None and _within(there, target)
        if back and (here.batch or self._faster_on_speculative(there, here, content)):
            return other, "conversation:moved"
        if here.ttft is None or here.ttft <= target or there.ttft is None:
            return home, stay
        if there.ttft < here.ttft * (1 - config.min_gain):
            return other, "conversation:moved"
        return home, stay

    def _faster_on_speculative(self, spec: PoolState, std: PoolState, content: ContentKind) -> bool:
        """Whether the speculative pool serves one more user faster: by the learned speeds beyond
        their noise (`adaptive`), else while the standard pool carries more requests."""
        spec_speed, std_speed = spec.speed.get(content), std.speed.get(content)
        if self._config.mode == "adaptive" and spec_speed is not None and std_speed is not None:
            return spec_speed.low > std_speed.high
        return std.concurrency > spec.concurrency

    @staticmethod
    def _unavailable(state: PoolState) -> str | None:
        """Why a pool takes no new work at all (`draining`, `down`), or None."""
        if state.draining:
            return "draining"
        if not state.healthy:
            return "down"
        return None

    def _wait(self, state: PoolState) -> str | None:
        """Why a request sent to a pool now would wait for its first token (`queueing`,
        `kv-full`, `full`, or why it is unavailable), or None."""
        unavailable = self._unavailable(state)
        if unavailable is not None:
            return unavailable
        if state.engine_queued > 0:
            return "queueing"
        if state.kv_usage is not None and state.kv_usage >= self._config.kv_threshold:
            return "kv-full"
        if not state.has_room:
            return "full"
        return None


def _within(state: PoolState, target: float) -> bool:
    """Whether a pool's first token is predicted within `target` (nothing predicted: taken as within)."""
    return state.ttft is None or state.ttft <= target


def _sooner(candidate: float | None, current: float | None) -> bool:
    """Whether a predicted first token comes sooner (unknown: not sooner)."""
    return candidate is not None and current is not None and candidate < current
