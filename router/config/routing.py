"""How a request is classified, and how the router picks its pool: rules, modes, readings, learning."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from router.config.base import JobClass, Section
from router.content import ContentKind


class Match(Section):
    """What a rule matches: all given fields must match; strings are shell-style globs (`*`, `?`)."""

    api_key: SecretStr | None = Field(default=None, description="The client's API key (never printed).")
    headers: dict[str, str] = Field(default={}, description="Header names and the globs their values must match.")
    user_agent: str | None = Field(default=None, description="The `User-Agent` header.")
    model: str | None = Field(default=None, description="The `model` the body names.")
    user: str | None = Field(default=None, description="The body's `user`.")
    metadata: dict[str, str] = Field(default={}, description="Keys of the body's `metadata` and their globs.")


class Rule(Section):
    """A classification rule: the first that matches decides the job class."""

    name: str = Field(description="Shown in `X-Route-Reason` as `rule:<name>`.")
    job: JobClass = Field(description="The job class of a matching request.")
    match: Match = Field(description="What the request must carry.")
    rewrite_model: str | None = Field(
        default=None, description="Forward the request with this model name (for an alias such as `glm-batch`)."
    )


# Keys that clients send because their library wants one, not to say who they are: vLLM's and
# SGLang's examples ("EMPTY", "none"), llama.cpp's and LM Studio's ("sk-no-key-required",
# "lm-studio"), Ollama's ("ollama"), and the fill-ins of tutorials.
PLACEHOLDER_KEYS = (
    "none",
    "null",
    "nil",
    "empty",
    "-",
    "x",
    "0",
    "no",
    "nokey",
    "no-key",
    "no_key",
    "sk-no-key-required",
    "not-needed",
    "not_needed",
    "unused",
    "anything",
    "dummy",
    "fake",
    "test",
    "key",
    "token",
    "secret",
    "api-key",
    "api_key",
    "apikey",
    "your-api-key",
    "your_api_key",
    "sk-xxx*",
    "sk-...*",
    "*placeholder*",
    "*dummy*",
    "*your*key*",
    "lm-studio",
    "ollama",
    "vllm",
    "sglang",
    "llama.cpp",
)


class Classify(Section):
    """How a request's job class is decided after the override headers: rules, then heuristics."""

    rules: list[Rule] = Field(
        default=[],
        description="Rules checked in order; the first match wins. Each is `{name, job, match: {api_key, headers, "
        "user_agent, model, user, metadata}, rewrite_model}`.",
    )
    batch_inflight_threshold: int = Field(
        default=4, ge=1, description="A client with this many requests in flight (before the new one) sends batch work."
    )
    client_memory_seconds: float = Field(
        default=60.0,
        ge=0,
        description="Seconds: half-life of the memory of a client's peak in flight, so a batch job stays one "
        "between bursts (0: no memory).",
    )
    burst_hold_seconds: float = Field(
        default=0.02,
        ge=0,
        description="Seconds the first requests of a client not seen lately are held (or until it has more than "
        "`batch_inflight_threshold` here), so a batch job's first burst is recognised as one (0: off).",
    )
    code_hints: list[str] = Field(
        default=[],
        description="Extra text that marks a request as code, besides tool definitions, code fences and code-like "
        "lines.",
    )
    placeholder_keys: list[str] = Field(
        default=list(PLACEHOLDER_KEYS),
        description="Bearer keys that tell nobody apart when no client keys are configured: shell-style patterns, "
        "compared without regard to case. Any other key separates its clients (kept only as a hash), even on an "
        "open router; these count as no key at all.",
    )


class Routing(Section):
    """Where each job class goes, and when interactive work leaves the speculative pool."""

    interactive_pool: str | None = Field(
        default=None, description="The pool of interactive work. Unset: the first speculative pool."
    )
    batch_pool: str | None = Field(default=None, description="The pool of batch work. Unset: the first standard pool.")
    mode: Literal["static", "crossover", "adaptive"] = Field(
        default="adaptive",
        description="`static`: interactive work to the speculative pool unless it is down or drained. `crossover`: "
        "it spills past the configured crossover concurrency. `adaptive`: to the pool with the higher learned "
        "per-user speed (see How routing works).",
    )
    crossover: dict[ContentKind, int] = Field(
        default={"prose": 4, "code": 16},
        description="Concurrency on a speculative backend past which it stops being the faster place, for `prose` "
        "and `code` (both required); in `adaptive` mode, the tie-break while the learned speeds are within noise.",
    )
    kv_threshold: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Share of a speculative engine's KV cache, once this request is placed, at which interactive "
        "work spills (`spill:spec-kv-full`): the next request would wait.",
    )
    batch_may_use_speculative: bool = Field(
        default=False,
        description="Let batch work use the speculative pool's idle room when the standard pool is down or full.",
    )
    ttft_target: float = Field(
        default=3.0,
        gt=0,
        description="Seconds: interactive work goes where its first token is predicted within this, then where it "
        "streams fastest.",
    )
    ttft_target_min: float = Field(
        default=0.05,
        gt=0,
        description="Seconds: the shortest first-token target a request may ask for with `X-SLO-TTFT-MS`; a "
        "shorter one is raised to this.",
    )
    ttft_target_max: float = Field(
        default=600.0,
        gt=0,
        description="Seconds: the longest first-token target a request may ask for; a longer one is lowered to this.",
    )
    reject_unmeetable_ttft: bool = Field(
        default=False,
        description="A request whose own first-token target no pool is predicted to meet is answered at once: "
        "503 `ttft_target_unmeetable`, with the predictions (false: it goes where its first token comes soonest, "
        "`X-Route-Reason: slo:unmet`).",
    )


class Scrape(Section):
    """How the engines' own `/metrics` are read (vLLM or SGLang names)."""

    interval: float = Field(default=1.0, gt=0, description="Seconds between reads of each engine's `/metrics`.")
    timeout: float = Field(default=0.5, gt=0, description="Seconds a read may take.")
    max_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        description="Bytes of a `/metrics` page read; a larger one fails the scrape, read no further (a vLLM 0.32 "
        "page is some 55 KB).",
    )
    stale_after: float = Field(
        default=5.0,
        gt=0,
        description="Seconds after which a reading is not used (the router then counts its own requests only).",
    )
    acceptance_max_age: float = Field(
        default=300.0,
        gt=0,
        description="Seconds the last speculative acceptance measured is used: an idle engine drafts nothing, so "
        "its newest scrapes have no figure of their own.",
    )


class Learn(Section):
    """How per-user speeds are learned from finished streams, per backend and content kind."""

    min_samples: int = Field(default=8, ge=1, description="Answers a learned speed point needs before it is used.")
    max_interval: float = Field(
        default=0.1,
        gt=0,
        description="...and its 95 % confidence interval must be within this share of its mean; also the interval "
        "given to a prior.",
    )
    half_life: float = Field(default=600.0, gt=0, description="Seconds after which an observed answer counts half.")
    prior_weight: float = Field(
        default=8.0,
        ge=0,
        description="How many answers a pool's `prior_speed` counts as where a learned point is trusted "
        "(0: the prior is used only where nothing is trusted).",
    )


class Conversations(Section):
    """How a conversation's turns are kept where its prompt is cached (see Conversations)."""

    enabled: bool = Field(
        default=True,
        description="Place a request on the backend most likely holding its prompt's prefix, and count the "
        "prefill of the part a pool does not hold in the predicted first token that decides a spill. Off: every "
        "request goes to the emptiest backend and spills on load alone.",
    )
    session_header: str = Field(
        default="X-Session-ID",
        description="The header that names a conversation (per client key and model); without it the prompt's "
        "leading text does.",
    )
    block_chars: int = Field(
        default=256,
        ge=16,
        le=65536,
        description="Characters per hashed block of a prompt's leading text (about 64 tokens), as llm-d's "
        "estimated prefix scorer cuts prompts without a tokenizer.",
    )
    max_blocks: int = Field(
        default=512,
        ge=1,
        le=65536,
        description="Leading blocks of a prompt hashed (512 × 256 characters: about 32,000 tokens); a longer "
        "prompt's tail is not told apart.",
    )
    max_entries: int = Field(
        default=200_000,
        ge=1,
        description="Prompt blocks remembered across all backends; past it the least recently placed go.",
    )
    max_conversations: int = Field(
        default=50_000, ge=1, description="Conversations remembered; past it the least recently seen go."
    )
    max_age: float = Field(
        default=1800.0,
        gt=0,
        description="Seconds after which a block placed on a backend is taken to be evicted there, and a "
        "conversation not seen is forgotten.",
    )
    load_bound: int = Field(
        default=4,
        ge=0,
        description="Requests more than the emptiest backend of its pool at which the backend holding a prompt's "
        "prefix is passed over for the emptiest.",
    )
    long_tokens: int = Field(
        default=2048,
        ge=0,
        description="Cached prompt tokens from which a conversation is long: it leaves the pool that holds them "
        "only when its first token there is predicted past `routing.ttft_target`, and the other pool's, its "
        "prefill counted, comes `min_gain` sooner.",
    )
    min_gain: float = Field(
        default=0.3,
        ge=0,
        lt=1,
        description="Share of the predicted first token a long conversation must gain to change pools, and a "
        "prompt no backend holds any of to go to another backend of its pool than the emptiest.",
    )
    settle_seconds: float = Field(
        default=60.0,
        ge=0,
        description="Seconds a conversation that changed pools stays in its new one (unless it becomes "
        "unavailable): no turn-by-turn ping-pong.",
    )
    prefill_token_seconds: float = Field(
        default=5e-5,
        gt=0,
        description="Seconds per prompt token prefilled, assumed for an engine until its own metrics "
        "(`vllm:request_prefill_time_seconds` over the prompt tokens it computed) give its rate.",
    )
