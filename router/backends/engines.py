"""What the engines say about their own load, and what the router projects from it.

`EngineLoad` is one scrape of one engine (router.scrape reads them); `EngineView` is what the
router keeps of an engine between scrapes: the latest reading, the KV one request takes, the
capacity the engine states, the last speculative acceptance measured. Its projections add what
this router sent since the reading, so a burst faster than the scrape interval is seen.

Nothing here does I/O or holds a clock: every reading of time comes in as `now`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of one engine. None: the engine does not export that figure."""

    running: float | None = None
    waiting: float | None = None
    # Waiting in this scrape and the one before: a queue, not a request caught between its
    # arrival and the engine's next step.
    queued: float | None = None
    kv_usage: float | None = None
    acceptance: float | None = None  # accepted ÷ drafted tokens since the previous scrape
    accept_length: float | None = None  # tokens a sequence gains per step (1 + accepted per draft)
    draft_tokens: float | None = None  # guessed tokens per step and sequence (k)
    # Requests the engine states its KV cache holds at full length (vLLM's cache_config_info),
    # and the cache's size in tokens, its block size and that full length, as it states them there.
    max_concurrency: float | None = None
    kv_cache_tokens: float | None = None
    block_size: float | None = None
    model_len: float | None = None
    # Requests that finished prefill since the previous scrape: their mean prompt tokens computed
    # (not cached) and their mean seconds in prefill (vLLM's request_prefill_time_seconds).
    prefill: tuple[float, float] | None = None
    scraped_at: float = 0.0  # clock seconds; 0 = never
    # This router's requests that the reading counts (EngineView.counted), still running when it
    # came back: none sent after the scrape was asked for, and maybe not all sent just before.
    own_in_flight: int = 0

    def fresh(self, now: float, stale_after: float) -> bool:
        return self.scraped_at > 0 and now - self.scraped_at <= stale_after


@dataclass(frozen=True, slots=True)
class Elsewhere:
    """One backend's figures on the other router replicas (router.replicas): their slots in use,
    and their requests sent since their own last reading of it."""

    in_flight: int = 0
    unread: int = 0


ALONE = Elsewhere()


@dataclass(frozen=True, slots=True)
class Acceptance:
    """The last speculative acceptance measured, and when."""

    ratio: float
    length: float | None
    measured_at: float


class EngineView:
    """One engine as the router sees it between scrapes. `in_flight` and `max_concurrency` are
    the router's own slots on it (router.backends), passed in by whoever asks; `elsewhere`, the
    other replicas' figures for it (router.replicas), added to the router's own."""

    def __init__(self) -> None:
        self.reading = EngineLoad()  # the latest scrape of its /metrics
        self.stale = False  # its readings went stale (logged once; fresh again logs again)
        self._kv_per_request: float | None = None  # KV usage per running request, as last seen
        # The last reading in which the engine stated its capacity (vLLM's cache_config_info):
        # requests of full length that fit, and the cache's size, block size and full length.
        self.stated = EngineLoad()
        self.acceptance: Acceptance | None = None
        self.prefill = PrefillRate()

    def observe(self, reading: EngineLoad) -> None:
        """A new reading. The KV per request is kept from the last reading that had requests
        running, and the acceptance from the last that had drafts, so an idle engine has both."""
        self.reading = reading
        if reading.running and reading.kv_usage is not None:
            self._kv_per_request = reading.kv_usage / reading.running
        if reading.max_concurrency or reading.kv_cache_tokens:
            self.stated = reading
        if reading.acceptance is not None:
            self.acceptance = Acceptance(reading.acceptance, reading.accept_length, reading.scraped_at)
        if reading.prefill is not None:
            self.prefill.observe(*reading.prefill)

    @property
    def stated_concurrency(self) -> float | None:
        """Requests of full length its KV cache holds, as the engine states it."""
        return self.stated.max_concurrency

    def counted(self, reading: EngineLoad, *, earlier: int, recent: int) -> int:
        """How many of this router's requests a new reading counts, of those running when it was
        asked for: `earlier`, sent before the previous reading was asked for, and `recent`, sent
        since.

        The earlier ones are in it. A recent one may not be: the engine answers the scrape on
        another connection and may not yet have read that request, or stepped with it. Of those,
        only as many are taken as counted as the reading rose above the others' load (other
        clients', other routers': the previous reading less this router's part of it). Taking
        them all would count one too few on the engine each time a scrape overtakes a request,
        and let one too many through. When the others' load falls in the same interval, this
        errs the other way, by that fall, until the next reading."""
        if reading.running is None:
            return earlier + recent
        previous = self.reading
        others = 0.0
        if previous.running is not None:
            others = max(0.0, previous.running + (previous.waiting or 0) - previous.own_in_flight)
        reported = reading.running + (reading.waiting or 0)
        return earlier + min(recent, max(0, round(reported - others) - earlier))

    def kv_per_request(self, max_concurrency: int, tokens: int | None = None) -> float:
        """KV usage one request of `tokens` (its prompt and the answer it allows) takes: its own
        share of the cache at its end (`_kv_of`) where its length and the cache's size are known;
        else the usage per running request the last reading with requests running showed; before
        one, the capacity the engine states or the configured `max_concurrency`, whichever is less.
        So a burst on a router that has not yet seen the engine loaded still projects it full."""
        own = self._kv_of(tokens)
        if own:
            return own
        if self._kv_per_request is not None:
            return self._kv_per_request
        stated = self.stated.max_concurrency
        slots = stated if stated and stated < max_concurrency else max_concurrency
        return 1.0 / slots if slots > 1 else 1.0

    def _kv_held(self, max_concurrency: int, in_flight: int, holding: Iterable[int]) -> float:
        """KV usage per request of this router's `in_flight` ones at their end: each of `holding`
        (the tokens of those whose length is known) its own share, the others as seen. Each is
        taken at what it holds, not at the size of the next: a standard engine running a batch
        job of short requests has room for a long prompt."""
        if not in_flight:
            return self.kv_per_request(max_concurrency)
        lengths = list(holding)
        # Each length's share once, summed in the requests' order (the same float as one by one):
        # thousands in flight hold a few lengths, and this runs for every request routed.
        shares = {tokens: self.kv_per_request(max_concurrency, tokens) for tokens in set(lengths)}
        known = sum(map(shares.__getitem__, lengths))
        unknown = max(0, in_flight - len(lengths)) * self.kv_per_request(max_concurrency)
        return (known + unknown) / max(in_flight, len(lengths))

    def _kv_of(self, tokens: int | None) -> float:
        """The share of the engine's KV cache a request of `tokens` (its prompt and the answer it
        allows, router.content) holds at its end, in whole blocks; 0 if either is unknown.

        vLLM states the requests of `max_model_len` its cache holds: the cache's size over that
        length. Where the engine states that length too and its capacity is less, the difference
        is what each request holds besides its tokens (the simulator's overhead). At most the
        share of a request of full length (the whole cache if unstated): a client's limit can be
        any integer."""
        stated = self.stated
        size = stated.kv_cache_tokens
        if not tokens or size is None or size < 1:
            return 0.0  # unknown, or no cache an engine could have
        overhead = 0.0
        if stated.max_concurrency and stated.model_len:
            overhead = max(0.0, size / stated.max_concurrency - stated.model_len)
        block = max(1.0, stated.block_size or 1.0)  # a block holds a token at least
        need = min(min(tokens, size) + overhead, size)  # compared first: an int past any float
        # No request holds more than one of full length, whatever its limit: the engine refuses
        # a longer one, and would on any pool.
        full_length = 1.0 / max(1.0, stated.max_concurrency or 1.0)
        return min(full_length, math.ceil(need / block) * block / size)

    def kv_projected(
        self,
        now: float,
        stale_after: float,
        *,
        in_flight: int,
        max_concurrency: int,
        tokens: int | None = None,
        holding: Iterable[int] = (),
        elsewhere: Elsewhere = ALONE,
    ) -> float | None:
        """The engine's KV usage once one more request, of `tokens`, is sent: the last reading,
        plus what each request sent since will hold (`holding`: the tokens of the router's
        requests in flight whose length is known, `_kv_held`), plus the new one at its own size.

        A reading lags by a scrape; users arriving faster than that would otherwise overfill a
        speculative engine's cache before the router sees it fill. Without a fresh reading, the
        router's own requests at what they hold.
        """
        fresh = self.reading.fresh(now, stale_after)
        share = self.kv_per_request(max_concurrency, tokens)
        return self._projected(fresh, share, in_flight, max_concurrency, holding, elsewhere)

    def _projected(
        self,
        fresh: bool,
        share: float,
        in_flight: int,
        max_concurrency: int,
        holding: Iterable[int],
        elsewhere: Elsewhere,
    ) -> float | None:
        """`kv_projected`, the reading's freshness and the new request's `share` worked out."""
        held = self._kv_held(max_concurrency, in_flight, holding)
        since = self._since_reading(fresh, in_flight=in_flight, held=held, elsewhere=elsewhere)
        if since is None:
            return None  # the engine says nothing of its KV cache
        usage, sent = since
        return usage + held * sent + share

    def overflow(
        self,
        now: float,
        stale_after: float,
        kv_threshold: float,
        *,
        in_flight: int,
        max_concurrency: int,
        holding: Iterable[int] = (),
        elsewhere: Elsewhere = ALONE,
    ) -> int:
        """This router's requests sent since the reading that the KV cache holds no room for below
        the threshold, as projected: they wait inside the engine for others to finish. A burst
        faster than a scrape queues there before any reading shows it."""
        held = self._kv_held(max_concurrency, in_flight, holding)
        fresh = self.reading.fresh(now, stale_after)
        since = self._since_reading(fresh, in_flight=in_flight, held=held, elsewhere=elsewhere)
        if since is None or held <= 0:
            return 0
        usage, sent = since
        # Room for one more than were sent is room for all (`held` an engine made near 0: `inf`).
        room = min((kv_threshold - usage) / held, sent + 1)
        return max(0, sent - max(0, math.ceil(room) - 1))

    def _since_reading(
        self, fresh: bool, *, in_flight: int, held: float, elsewhere: Elsewhere
    ) -> tuple[float, int] | None:
        """The KV usage of the last reading, with this router's requests in it grown to what they
        will hold, and the router's requests it does not count: with no `fresh` reading (scrapes
        failing: the engine, or this router, too busy to answer in time), none and all of them, so
        that missed scrapes do not open the gate. None: the engine says nothing of its KV cache.

        An engine that allocates KV as tokens come (vLLM, in blocks) shows a request just admitted
        at its prompt's blocks. The router's own requests in the reading and still running are
        taken to grow from the reading's usage per running request to `held` (what the router's
        requests hold at their end, each) by their end, as it takes those sent since (other
        clients' requests, of unknown length, as read). Taken as it read, a reading in the middle
        of a burst on the real engines (ten requests of one block, of the two each would hold) let
        two too many through, and the speculative engine preempted requests to make room for them.

        The other replicas' requests count as this router's do: all of them without a fresh
        reading, else those they sent since their own last reading."""
        reading = self.reading
        if reading.kv_usage is None:
            return None
        if not fresh:
            return 0.0, in_flight + elsewhere.in_flight
        usage = reading.kv_usage
        if reading.running:
            growing = min(reading.own_in_flight, in_flight)
            usage += growing * max(0.0, held - reading.kv_usage / reading.running)
        return usage, max(0, in_flight - reading.own_in_flight) + elsewhere.unread

    def _has_room(self, fresh: bool, share: float, kv_threshold: float, max_concurrency: int) -> bool:
        """Whether the last reading, if `fresh`, shows a free slot and KV headroom for one more
        request taking `share`. Requests it reports waiting meanwhile are passing through, not a queue."""
        reading = self.reading
        if not fresh or (reading.running is not None and reading.running >= max_concurrency):
            return False
        return reading.kv_usage is None or reading.kv_usage + share < kv_threshold

    def concurrency(self, now: float, stale_after: float, *, in_flight: int, elsewhere: Elsewhere = ALONE) -> int:
        """Requests on the engine: what it reported, plus what this router sent it since.

        The engine's figure includes other clients and other routers, but lags by a scrape;
        the router's own count is exact but sees only itself. Never less than the latter.
        """
        return self._concurrency(self.reading.fresh(now, stale_after), in_flight, elsewhere)

    def _concurrency(self, fresh: bool, in_flight: int, elsewhere: Elsewhere) -> int:
        reading = self.reading
        everywhere = in_flight + elsewhere.in_flight
        if not fresh or reading.running is None:
            return everywhere
        reported = reading.running + (reading.waiting or 0)
        return max(everywhere, round(reported) + max(0, in_flight - reading.own_in_flight) + elsewhere.unread)

    def outlook(
        self,
        now: float,
        stale_after: float,
        kv_threshold: float,
        *,
        in_flight: int,
        max_concurrency: int,
        tokens: int | None = None,
        holding: Iterable[int] = (),
        elsewhere: Elsewhere = ALONE,
    ) -> tuple[bool, float | None, bool, int]:
        """Whether the reading is fresh, `kv_projected`, whether the engine has room of its own
        (`_has_room`) and `concurrency`, in one: the snapshot reads all four of every engine for
        every request routed (router.routing.snapshot), the freshness and the new request's share
        of the cache worked out once."""
        fresh = self.reading.fresh(now, stale_after)
        share = self.kv_per_request(max_concurrency, tokens)
        return (
            fresh,
            self._projected(fresh, share, in_flight, max_concurrency, holding, elsewhere),
            self._has_room(fresh, share, kv_threshold, max_concurrency),
            self._concurrency(fresh, in_flight, elsewhere),
        )

    def free_tokens(self, now: float, stale_after: float) -> float | None:
        """Tokens of the engine's KV cache that no running request holds, as last read: all a
        prefix cache keeps of idle prompts fits there (vLLM evicts it as requests need blocks).
        None: no fresh reading, or the engine does not state its cache's size."""
        reading, size = self.reading, self.stated.kv_cache_tokens
        if size is None or reading.kv_usage is None or not reading.fresh(now, stale_after):
            return None
        return max(0.0, 1.0 - reading.kv_usage) * size

    def accept_length(self, now: float, max_age: float) -> float | None:
        """Tokens a sequence gains per step, as last measured, if not older than `max_age`."""
        if self.acceptance is None or now - self.acceptance.measured_at > max_age:
            return None
        return self.acceptance.length


class PrefillRate:
    """Seconds an engine takes per prompt token it computes, learned from its own metrics.

    Each scrape interval gives the mean tokens computed and the mean seconds in prefill of the
    requests that finished prefill in it. The slope of the seconds over the tokens, fitted over
    the last intervals, is the rate: a mean alone would charge every token a share of each
    request's fixed cost, and price a long prompt as many short ones. Without enough spread
    between the intervals' lengths to fit a slope, there is no rate.
    """

    SAMPLES = 64  # intervals kept
    MIN_SPREAD = 2.0  # the longest mean prompt over the shortest, for a slope
    # Past these, a reading is a broken engine's, and its squares would overflow the fit.
    MAX_TOKENS = 2.0**31  # mean prompt tokens computed per request
    MAX_SECONDS = 86_400.0  # mean seconds in prefill per request

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=self.SAMPLES)

    def observe(self, tokens: float, seconds: float) -> None:
        if 0 < tokens <= self.MAX_TOKENS and 0 <= seconds <= self.MAX_SECONDS:
            self._samples.append((tokens, seconds))

    @property
    def seconds_per_token(self) -> float | None:
        samples = self._samples
        if len(samples) < 4:
            return None
        xs = [x for x, _ in samples]
        if max(xs) < self.MIN_SPREAD * min(xs):
            return None
        mean_x = sum(xs) / len(xs)
        mean_y = sum(y for _, y in samples) / len(samples)
        var = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in samples) / var
        return slope if slope > 0 else None
