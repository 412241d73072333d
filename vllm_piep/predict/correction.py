"""A meter's correction of the analytic prior: its static and dynamic parts scaled by the
ratios a server in measured mode fitted (`piep_measured_ratio`), as a small JSON file, written
by `python -m vllm_piep.calibrate from-metrics` and served with `prior_correction` where no meter
serves. JSON only, validated on read.

The file records the meter the server measured with and whether it measures or estimates or
simulates (`meter`, `meter_source`): a prior fitted to a CPU estimate or a simulator serves as
`estimated` or `simulated`, never as `calibrated`. A file of the first schema
(`vllm_piep/prior-correction/1`) records no meter, so what it may say cannot be told: it is
refused, naming the command that remakes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vllm_piep.meters.common import Source as MeterSource
from vllm_piep.predict.base import Source, fitted_source

SCHEMA = "vllm_piep/prior-correction/2"
SCHEMA_WITHOUT_METER = "vllm_piep/prior-correction/1"


class PriorCorrection(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_id: Literal["vllm_piep/prior-correction/2"] = Field(SCHEMA, alias="schema")
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
    meter: str = Field(min_length=1, description="the meter the server measured with "
                       "(piep_engine_measured)")
    meter_source: MeterSource = Field(
        description="whether that meter measures (measured) or estimates or simulates "
        "(estimated, simulated), as its energy is labelled on /metrics")

    @property
    def served_source(self) -> Source:
        """What a prior served with this correction says."""
        return fitted_source(self.meter_source)

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
        if isinstance(raw, dict) and raw.get("schema") == SCHEMA_WITHOUT_METER:
            raise ValueError(f"prior correction {path}: schema {SCHEMA_WITHOUT_METER} does not "
                             "record the meter it was fitted to, so whether that meter measured "
                             "cannot be told; remake it with `python -m vllm_piep.calibrate "
                             "from-metrics`")
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:  # the first problem, with the field it is in
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ValueError(f"prior correction {path}: {where + ': ' if where else ''}"
                             f"{first['msg']}") from None
