"""Engine profiles: plain data describing one engine configuration on some hardware.

A profile says how much fits (sequences, KV cache) and how long a scheduler step takes. The
step model follows the mechanism in the field note: a mixture-of-experts step costs a fixed
part, plus the share of the experts that the step's tokens touch (it saturates as tokens grow),
plus parts per token, per sequence and per token of context; speculation adds a drafter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from router.content import ContentKind

# Shipped inside the package; `config/profiles` links here.
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepCost(_Data):
    base_s: float = Field(ge=0, description="fixed cost of a step: dense layers, communication, launch")
    expert_s: float = Field(ge=0, description="cost of reading every expert once")
    expert_share_per_token: float = Field(gt=0, le=1, description="share of the experts one token touches")
    token_s: float = Field(ge=0, description="per token decoded or verified in the step")
    sequence_s: float = Field(ge=0, description="per running sequence in the step")
    context_s: float = Field(ge=0, description="per token of context of each running sequence")
    prefill_token_s: float = Field(ge=0, description="per prompt token prefilled (computed, not cached) in the step")
    prefill_context_s: float = Field(
        default=0.0, ge=0, description="per prompt token prefilled and token of context before it (attention)"
    )
    prefill_request_s: float = Field(default=0.0, ge=0, description="per request whose prefill starts in the step")


class Speculation(_Data):
    num_tokens: int = Field(ge=1, description="tokens the drafter guesses per sequence and step (k)")
    draft_s: float = Field(ge=0, description="fixed drafter cost per guessed position")
    draft_token_s: float = Field(ge=0, description="drafter cost per guessed token")
    accepted_token_s: float = Field(ge=0, description="cost per accepted token (drafter catch-up)")
    acceptance: dict[ContentKind, float] = Field(description="chance that each next guess is right")


class Profile(_Data):
    name: str
    description: str = ""
    model: str = "glm-5.3-flash"
    nodes: int = Field(default=4, ge=1)
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    kv_cache_tokens: int = Field(ge=1)
    kv_overhead_tokens: int = Field(default=0, ge=0, description="KV reserved per request beyond prompt+answer")
    default_max_tokens: int = Field(default=2048, ge=1)
    max_model_len: int = Field(default=131072, ge=1)
    block_size: int = Field(default=16, ge=1, le=4096, description="tokens per KV block, the prefix cache's unit")
    prefix_caching: bool = Field(
        default=True, description="keep prompt and answer blocks cached in free KV space, as vLLM's APC"
    )
    embedding_size: int = Field(default=1024, ge=1, le=65536, description="length of `/v1/embeddings` vectors")
    step: StepCost
    speculation: Speculation | None = None

    @property
    def speculative(self) -> bool:
        return self.speculation is not None


ProfileName = Literal["fast", "team"]


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (`fast`, `team`) or a YAML file of one's own."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    return Profile(**yaml.safe_load(path.read_text()))
