"""The traffic record's entries: one line per request the router served, and reading them back.

Shared by the router, which writes them (router.traffic), and the tools that replay them
(`specroute trace export`, `specroute plan`): sizes, classes and hashes, never prompt text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FORMAT = 1  # the first field of every line; a line of another format is skipped when read


@dataclass(frozen=True, slots=True)
class Served:
    """One request in the record."""

    at: float  # Unix seconds at arrival
    job: str  # interactive | batch
    kind: str  # prose | code
    prompt_tokens: int
    answer_tokens: int
    status: int
    client: str | None = None  # a hash, as the access log shows it
    conversation: str | None = None  # a hash of its session header or the response it continues
    declared: bool = False  # the client named its job type (header or rule): replayed as declared
    ttft: float | None = None  # seconds, as the router saw it
    duration: float = 0.0

    def line(self) -> str:
        return json.dumps(
            [FORMAT, round(self.at, 3), self.job, self.kind, self.prompt_tokens, self.answer_tokens, self.status,
             self.client, self.conversation, int(self.declared),
             None if self.ttft is None else round(self.ttft, 4), round(self.duration, 4)],
            separators=(",", ":"),
        )  # fmt: skip

    @classmethod
    def parse(cls, line: str) -> Served | None:
        """An entry from one line of the record, or None for a line that is not one (a torn last
        line, another format, a file edited by hand)."""
        try:
            row = json.loads(line)
            if not isinstance(row, list) or len(row) != 12 or row[0] != FORMAT:
                return None
            _, at, job, kind, prompt, answer, status, client, conversation, declared, ttft, duration = row
            entry = cls(
                at=float(at), job=str(job), kind=str(kind), prompt_tokens=int(prompt), answer_tokens=int(answer),
                status=int(status), client=None if client is None else str(client),
                conversation=None if conversation is None else str(conversation), declared=bool(declared),
                ttft=None if ttft is None else float(ttft), duration=float(duration),
            )  # fmt: skip
        except (ValueError, TypeError):
            return None
        if entry.job not in ("interactive", "batch") or entry.kind not in ("prose", "code"):
            return None
        if min(entry.prompt_tokens, entry.answer_tokens) < 0 or not 0 <= entry.at < 1e11:
            return None
        return entry

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def parse_any(cls, line: str) -> Served | None:
        """An entry from a line of the record or of `specroute trace export` (a JSON object)."""
        if not line.lstrip().startswith("{"):
            return cls.parse(line)
        try:
            data = json.loads(line)
            row = [FORMAT, *(data[name] for name in FIELDS)]
        except (ValueError, KeyError, TypeError):
            return None
        return cls.parse(json.dumps(row))


FIELDS = (
    "at", "job", "kind", "prompt_tokens", "answer_tokens", "status", "client", "conversation", "declared", "ttft",
    "duration",
)  # fmt: skip


def conversation_hash(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:12]


def older_file(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def read_record(path: str | Path) -> Iterator[Served]:
    """The entries of a record, oldest first: the file moved aside, then the current one (or an
    export of it). Lines that are not entries are skipped."""
    target = Path(path)
    for file in (older_file(target), target):
        if not file.exists():
            continue
        with file.open("r", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if len(line) > 4096:
                    continue
                entry = Served.parse_any(line)
                if entry is not None:
                    yield entry
