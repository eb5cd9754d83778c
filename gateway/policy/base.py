"""What every part of the policy model is made of: strict, frozen objects and the value rules
they share (gateway/policy/model.py, prefix.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
Name = Annotated[str, Field(pattern=NAME_RE, max_length=64)]
PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]


class Strict(BaseModel):
    """Unknown keys are errors (an SRE's typo is caught at load); values never change."""

    model_config = ConfigDict(extra="forbid", frozen=True)
