"""A continuous-batching scheduler in simulated time. No I/O and no clock: `step()` advances it.

Each step, in the order vLLM's scheduler works:
1. Admit waiting requests in arrival order while there is a sequence slot and their whole
   KV reservation (prompt + max tokens + the profile's overhead) fits. The first that does
   not fit blocks the ones behind it (FIFO), which is what makes the note's fast setup stall
   at 23 requests; a request alone runs whatever it reserves. An admitted request starts from
   the leading blocks of its prompt that the prefix cache holds (router.sim.cache); cached
   blocks nobody holds fill the free KV space and are evicted as reservations take it.
2. Every decoding sequence takes its tokens for the step (k+1 verified with speculation, else 1);
   what is left of the step's token budget prefills the uncached part of admitted prompts, in
   chunks.
3. The step lasts as long as the profile's cost model says for that work.
4. Decoding sequences gain their tokens (with speculation: the accepted guesses plus one); a
   sequence whose prefill completed gains its first token. Each full block of a prompt and its
   answer is cached once computed (all but the newest token). Finished sequences free their KV.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from router.content import ContentKind
from router.sim.cache import PrefixCache, block_hash, text_tokens
from router.sim.profile import Profile


@dataclass(eq=False)
class SimRequest:
    id: str
    prompt_tokens: int
    max_tokens: int
    target_tokens: int  # where it stops: max_tokens, or earlier at its natural end
    kind: ContentKind
    arrival: float = 0.0
    blocks: tuple[bytes, ...] = ()  # the prompt's full blocks, hashed, then the answer's
    tail: list[str] | None = None  # tokens after the last full block (None: unknown, answer not cached)
    cached: int = 0  # prompt tokens found in the prefix cache at admission
    held: int = 0  # leading blocks this request holds in the cache
    prefilled: int = 0
    scheduled_at: float | None = None  # when it was admitted
    prefill_started_at: float | None = None  # when the step computing its first prompt chunk began
    generated: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    aborted: bool = False
    rng: random.Random = field(default_factory=random.Random, repr=False)
    text: Iterator[str] | None = field(default=None, repr=False)  # the answer's pieces, one a token
    said: list[str] = field(default_factory=list, repr=False)  # the pieces generated so far
    hashed: int = 0  # pieces of `said` counted into `tail` or a block

    @property
    def reservation(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.prompt_tokens


@dataclass(frozen=True, slots=True)
class Emission:
    request: SimRequest
    tokens: int
    finished: bool


@dataclass
class Counters:
    """Cumulative engine counters, named after vLLM's metrics."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of them, found cached


class Engine:
    def __init__(self, profile: Profile, *, seed: int = 0) -> None:
        self.profile = profile
        self.seed = seed
        self.now = 0.0
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.reserved = 0
        self.counters = Counters()
        self.cache = PrefixCache(profile.block_size) if profile.prefix_caching else None
        spec = profile.speculation
        self._k = spec.num_tokens if spec else 0

    # -- requests -------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        *,
        prompt_tokens: int,
        max_tokens: int | None,
        kind: ContentKind,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        blocks: tuple[bytes, ...] = (),
        tail: Sequence[str] | None = None,
    ) -> SimRequest:
        limit = max(1, min(max_tokens or self.profile.default_max_tokens, self.profile.max_model_len - prompt_tokens))
        rng = random.Random(zlib.crc32(f"{self.seed}:{request_id}".encode()))
        natural = rng.randint(96, 768)  # where a greedy answer would end by itself
        target = limit if ignore_eos else max(min(natural, limit), min(min_tokens, limit))
        request = SimRequest(request_id, prompt_tokens, limit, target, kind, arrival=self.now, blocks=blocks, rng=rng)
        request.tail = None if tail is None else list(tail)
        self.waiting.append(request)
        return request

    def abort(self, request: SimRequest) -> None:
        """The client went away: drop the request and free its KV at once."""
        if request.finished_at is not None or request.aborted:
            return
        request.aborted = True
        self.counters.aborted += 1
        if request in self.running:
            self._free(request)
        else:
            self.waiting.remove(request)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.reserved / self.profile.kv_cache_tokens

    # -- one step -------------------------------------------------------------------------

    def step(self) -> list[Emission]:
        """Run one scheduler step; advance `now` by its duration and return what it produced."""
        self._admit()
        if not self.running:
            return []
        budget = self.profile.max_num_batched_tokens
        decoding = [r for r in self.running if r.decoding]
        per_sequence = self._k + 1
        budget -= per_sequence * len(decoding)
        prefill_tokens = starting = 0
        attention = 0.0  # prefilled tokens × the context each attends to
        completing: list[SimRequest] = []
        for request in self.running:
            if request.decoding or budget <= 0:
                continue
            if request.prefilled == request.cached:
                starting += 1
                request.prefill_started_at = self.now
            chunk = min(request.prompt_tokens - request.prefilled, budget)
            attention += chunk * (request.prefilled + chunk / 2)
            request.prefilled += chunk
            budget -= chunk
            prefill_tokens += chunk
            if request.decoding:
                completing.append(request)
                if self.cache is not None:  # its blocks are computed: cached from now on
                    self.cache.hold(request.blocks[request.held :])
                    request.held = len(request.blocks)

        accepted_total = 0
        gains: list[tuple[SimRequest, int]] = []
        for request in decoding:
            accepted = self._accepted(request)
            accepted_total += accepted
            gains.append((request, accepted + 1))
        self.now += self._duration(decoding, prefill_tokens, starting, accepted_total)
        self.now += self.profile.step.prefill_context_s * attention
        self.counters.prompt_tokens += prefill_tokens

        emissions = []
        for request, gained in gains:
            emissions.append(self._emit(request, gained))
        for request in completing:
            request.first_token_at = self.now
            emissions.append(self._emit(request, 1))
        return emissions

    def _admit(self) -> None:
        capacity = self.profile.kv_cache_tokens
        while self.waiting and len(self.running) < self.profile.max_num_seqs:
            request = self.waiting[0]
            need = self._reservation(request)
            if self.reserved + need > capacity and self.running:
                return  # alone, a request runs whatever its reservation: as vLLM, never stuck waiting
            self.waiting.popleft()
            self.reserved += need
            self.running.append(request)
            request.scheduled_at = self.now
            if self.cache is not None:
                self._look_up(request)
                self.cache.fit(capacity - self.reserved)

    def _look_up(self, request: SimRequest) -> None:
        assert self.cache is not None
        request.held = self.cache.hit_blocks(request.blocks, request.prompt_tokens)
        self.cache.hold(request.blocks[: request.held])
        request.cached = request.prefilled = request.held * self.cache.block_size
        self.counters.prefix_queries += request.prompt_tokens
        self.counters.prefix_hits += request.cached
        self.counters.prompt_tokens += request.cached  # vLLM counts a prompt's cached tokens too

    def _free(self, request: SimRequest) -> None:
        self.running.remove(request)
        self.reserved -= self._reservation(request)
        if self.cache is not None:
            self.cache.release(request.blocks[: request.held])

    def _cache_answer(self, request: SimRequest) -> None:
        """Hold the answer's blocks as they fill, as vLLM caches every full block of a request's
        computed tokens: all but the newest, which the next step would compute."""
        assert self.cache is not None and request.tail is not None
        computed = len(request.said) - 1
        for piece in request.said[request.hashed : computed]:
            request.tail += text_tokens(piece)  # the tokens of the text the next turn sends back
        request.hashed = max(request.hashed, computed)
        size = self.cache.block_size
        while len(request.tail) >= size:
            block = block_hash(request.blocks[-1] if request.blocks else b"", request.tail[:size])
            del request.tail[:size]
            request.blocks += (block,)
            request.held += 1
            self.cache.hold((block,))

    def _reservation(self, request: SimRequest) -> int:
        return request.reservation + self.profile.kv_overhead_tokens

    def _accepted(self, request: SimRequest) -> int:
        spec = self.profile.speculation
        if spec is None:
            return 0
        rate = spec.acceptance[request.kind]
        accepted = 0
        while accepted < self._k and request.rng.random() < rate:
            accepted += 1
        self.counters.spec_drafts += 1
        self.counters.spec_draft_tokens += self._k
        self.counters.spec_accepted_tokens += accepted
        return accepted

    def _duration(self, decoding: list[SimRequest], prefill_tokens: int, starting: int, accepted: int) -> float:
        cost = self.profile.step
        decode_tokens = (self._k + 1) * len(decoding)
        context = sum(r.prompt_tokens + r.generated for r in decoding)
        tokens = decode_tokens + prefill_tokens
        share = 1.0 - math.pow(1.0 - cost.expert_share_per_token, tokens)
        seconds = (
            cost.base_s
            + cost.expert_s * share
            + cost.token_s * decode_tokens
            + cost.sequence_s * len(decoding)
            + cost.context_s * context
            + cost.prefill_token_s * prefill_tokens
            + cost.prefill_request_s * starting
        )
        spec = self.profile.speculation
        if spec is not None and decoding:
            seconds += spec.draft_s * self._k + spec.draft_token_s * self._k * len(decoding)
            seconds += spec.accepted_token_s * accepted
        return seconds

    def _emit(self, request: SimRequest, gained: int) -> Emission:
        gained = min(gained, request.target_tokens - request.generated)
        request.generated += gained
        self.counters.generation_tokens += gained
        if request.text is not None:
            request.said += itertools.islice(request.text, gained)
            if self.cache is not None and request.tail is not None:
                self._cache_answer(request)
        finished = request.generated >= request.target_tokens
        if finished:
            request.finished_at = self.now
            self._free(request)
            self.counters.finished += 1
        return Emission(request, gained, finished)
