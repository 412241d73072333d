"""Checks shared by the work-formula tests."""

from __future__ import annotations

import pytest

from vllm_piep.model.components import INDEX
from vllm_piep.model.flops import (
    MODULE_COMPONENT,
    ModelShape,
    ModuleWork,
    StepBatch,
    StepWork,
    module_kind,
    module_work,
    step_work,
)


def assert_modules_sum_to_step_work(shape: ModelShape, batch: StepBatch
                                    ) -> tuple[dict[str, ModuleWork], StepWork]:
    """Every component's FLOPs and bytes, summed over its modules, equal `step_work`'s."""
    modules = module_work(shape, batch)
    work = step_work(shape, batch)
    for component in set(MODULE_COMPONENT.values()):
        mine = [w for k, w in modules.items() if MODULE_COMPONENT[module_kind(k)] == component]
        col = INDEX[component]
        assert sum(w.flops for w in mine) == pytest.approx(work.flops[:, col].sum(), rel=1e-9)
        assert sum(w.bytes for w in mine) == pytest.approx(work.mem_bytes[:, col].sum(),
                                                           rel=1e-9)
    return modules, work
