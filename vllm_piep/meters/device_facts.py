"""What the host's GPU tool reports about the engine's first GPU, for a generic profile where no
datasheet profile fits: NVML on NVIDIA, else AMD SMI on AMD."""

from __future__ import annotations

from vllm_piep.meters.amdsmi import first_instance_amd_facts
from vllm_piep.meters.common import MeterError
from vllm_piep.meters.gpus import first_instance_gpu_facts
from vllm_piep.model.devices import GpuFacts


def instance_gpu_facts(ordinal: int = 0) -> GpuFacts:
    """The facts of device `ordinal` of this process; MeterError naming both tools' reasons
    when neither can tell."""
    try:
        return first_instance_gpu_facts(ordinal=ordinal)
    except MeterError as nvml_error:
        try:
            return first_instance_amd_facts(ordinal)
        except MeterError as amd_error:
            raise MeterError(f"{nvml_error}; {amd_error}") from amd_error
