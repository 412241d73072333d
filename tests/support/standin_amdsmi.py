"""A stand-in `amdsmi` module for the AMD meter's tests, placed where the real one is imported:
boards with an energy accumulator that advances at a set power (its resolution, width and
start chosen per board, updated every `period_s`), socket power, PCI addresses, compute
partitions (several processors on one board), and AMD SMI's errors."""

from __future__ import annotations

import time
from dataclasses import dataclass


class AmdSmiLibraryException(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"AMD SMI error {code}")
        self.code = code

    def get_error_code(self) -> int:
        return self.code

    def get_error_info(self) -> str:
        return str(self)


@dataclass
class Board:
    bdf: str  # the board's first PCI address; its partitions add their function number
    power_w: float = 300.0
    name: str = "AMD Instinct MI300X"
    resolution_uj: float = 15.3
    width: int = 64  # bits of the accumulator
    start: int = 0
    energy: bool = True  # False: the accumulator is not supported (NOT_SUPPORTED)
    partitions: int = 1
    mode: str = "SPX"
    back_by: int = 0  # counts the accumulator loses once, after `back_after_s`
    back_after_s: float = 1e9


class StandinAmdSmi:
    def __init__(self, boards: list[Board], period_s: float = 0.001) -> None:
        self.boards = boards
        self.period_s = period_s
        self.t0 = time.monotonic()
        self.processors = [(b, k) for b in boards for k in range(b.partitions)]
        self.initialised = 0

    def amdsmi_init(self) -> None:
        self.initialised += 1

    def amdsmi_shut_down(self) -> None:
        self.initialised -= 1

    def amdsmi_get_processor_handles(self) -> list[int]:
        return list(range(len(self.processors)))

    def amdsmi_get_gpu_device_bdf(self, handle: int) -> str:
        board, k = self.processors[handle]
        return f"{board.bdf[:-1]}{k}"

    def amdsmi_get_gpu_asic_info(self, handle: int) -> dict:
        return {"market_name": self.processors[handle][0].name}

    def amdsmi_get_gpu_compute_partition(self, handle: int) -> str:
        return self.processors[handle][0].mode

    def amdsmi_get_energy_count(self, handle: int) -> dict:
        board = self.processors[handle][0]
        if not board.energy:
            raise AmdSmiLibraryException(2)
        elapsed = time.monotonic() - self.t0
        updated = elapsed - elapsed % self.period_s
        count = board.start + int(board.power_w * updated / (board.resolution_uj / 1e6))
        if elapsed > board.back_after_s:
            count -= board.back_by
        return {"energy_accumulator": count % (1 << board.width),
                "counter_resolution": board.resolution_uj, "timestamp": int(updated * 1e9)}

    def amdsmi_get_power_info(self, handle: int) -> dict:
        power = int(self.processors[handle][0].power_w)
        return {"current_socket_power": power, "average_socket_power": power}
