"""What is running: the package version, the source commit if known, the Python."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# Set by the container build (docker/Dockerfile), where the image has no git checkout.
COMMIT_ENV = "SPECROUTE_GIT_COMMIT"


@dataclass(frozen=True, slots=True)
class BuildInfo:
    version: str
    commit: str  # "" when unknown
    python: str

    def as_dict(self) -> dict[str, str | None]:
        return {"version": self.version, "commit": self.commit or None, "python": self.python}


def build_info() -> BuildInfo:
    try:
        version = metadata.version("specroute")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return BuildInfo(version=version, commit=_commit(), python=platform.python_version())


def _commit() -> str:
    if commit := os.environ.get(COMMIT_ENV, "").strip():
        return commit
    # An editable install from a checkout: ask git, briefly; anything else means "unknown".
    source = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""
