"""What every section of the settings shares."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

JobClass = Literal["interactive", "batch"]


class Section(BaseModel):
    """A section of the settings: unknown keys are an error, values never change once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)
