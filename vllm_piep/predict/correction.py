"""A meter's correction of the analytic prior: its static and dynamic parts scaled by the
ratios a server in measured mode fitted (`piep_measured_ratio`), as a small JSON file, written
by `python -m vllm_piep.calibrate from-metrics` and served with `prior_correction` where no meter
serves. JSON only, validated on read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA = "vllm_piep/prior-correction/1"


class PriorCorrection(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_id: Literal["vllm_piep/prior-correction/1"] = Field(SCHEMA, alias="schema")
    static_ratio: float = Field(gt=0, allow_inf_nan=False,
                                description="measured / predicted static energy")
    dynamic_ratio: float = Field(gt=0, allow_inf_nan=False,
                                 description="measured / predicted dynamic energy")
    bundle: str = Field(description="the prior it corrects, e.g. prior/nvidia-h100-sxm")
    measured_joules: float = Field(ge=0, description="the meter's energy behind the fit")
    predicted_joules: float = Field(ge=0, description="the prior's figure for the same steps")
    engines: int = Field(ge=1)
    source: str = Field(description="where the figures were read")
    created: str

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(by_alias=True, indent=2) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> PriorCorrection:
        """ValueError naming the file and what is wrong."""
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"prior correction {path}: cannot read it ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"prior correction {path}: not JSON ({exc.msg}, line "
                             f"{exc.lineno})") from None
        try:
            return cls.model_validate(raw)
        except Exception as exc:  # pydantic's message names the field
            first = str(exc).splitlines()
            raise ValueError(f"prior correction {path}: {' '.join(first[1:3]).strip()}"
                             ) from None
