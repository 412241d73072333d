"""A stand-in `amdsmi` module for the AMD meter's tests, placed where the real one is imported:
boards with an energy accumulator that advances at a set power (its resolution, width and
start chosen per board, updated every `period_s`), socket power, PCI addresses, compute
partitions (several processors on one board), an MI250's second die (no power of its own),
the facts a generic profile is built from (in AMD SMI's units: power cap in µW, clocks in MHz,
bandwidth in GB/s, strings "N/A" where unknown), and AMD SMI's errors. The accumulators follow
`clock` (integer nanoseconds, default CLOCK_MONOTONIC; a test passes its own fake clock)."""

from __future__ import annotations

import time
from collections.abc import Callable
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
    second_die: bool = False  # an MI250's second GCD: its module's power shows on the first
    cap_w: float = 750.0
    compute_units: int | str = 304
    gfx_target: str = "gfx942"
    gfx_mhz: int = 2100
    vram_gb_s: float | str = 5300.0
    pcie: tuple[int, int] = (5, 16)
    device_id: str = "0x74a1"  # the PCI device ID (0x74a1: MI300X), as AMD SMI gives it
    vram_bytes: int = 192 << 30


class StandinAmdSmi:
    """The module: what the meter reads, and the names vLLM's ROCm platform imports."""

    AmdSmiException = AmdSmiLibraryException
    AmdSmiLibraryException = AmdSmiLibraryException

    class AmdSmiMemoryType:
        VRAM, VIS_VRAM, GTT = 0, 1, 2

    def __init__(self, boards: list[Board], period_s: float = 0.001,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.boards = boards
        self.period_s = period_s
        self.clock = clock
        self.t0_ns = clock()
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
        board = self.processors[handle][0]
        return {"market_name": board.name, "num_compute_units": board.compute_units,
                "target_graphics_version": board.gfx_target, "device_id": board.device_id}

    def amdsmi_get_power_cap_info(self, handle: int) -> dict:
        cap = int(self.processors[handle][0].cap_w * 1e6)
        return {"power_cap": cap, "default_power_cap": cap, "min_power_cap": 0,
                "max_power_cap": cap, "dpm_cap": 0}

    class AmdSmiClkType:
        GFX, MEM = 0, 1

    def amdsmi_get_clock_info(self, handle: int, clk_type: int) -> dict:
        if clk_type != self.AmdSmiClkType.GFX:
            return {"clk": 1300, "min_clk": 900, "max_clk": 1300}
        mhz = self.processors[handle][0].gfx_mhz
        return {"clk": 132, "min_clk": 132, "max_clk": mhz, "clk_locked": False}

    def amdsmi_get_gpu_vram_info(self, handle: int) -> dict:
        return {"vram_type": 8, "vram_bit_width": 8192, "vram_size": 196608,
                "vram_max_bandwidth": self.processors[handle][0].vram_gb_s}

    def amdsmi_get_pcie_info(self, handle: int) -> dict:
        gen, width = self.processors[handle][0].pcie
        return {"pcie_static": {"max_pcie_width": width, "max_pcie_speed": 32000,
                                "pcie_interface_version": gen, "slot_type": "OAM"}}

    def amdsmi_get_gpu_device_uuid(self, handle: int) -> str:
        return f"{handle:02x}ff74a1-0000-1000-80f3-4b0c1f0e0c{handle:02x}"

    def amdsmi_get_gpu_memory_total(self, handle: int, memory_type: int) -> int:
        return self.processors[handle][0].vram_bytes

    def amdsmi_topo_get_link_type(self, a: int, b: int) -> dict:
        return {"hops": 1, "type": 4}  # XGMI

    def amdsmi_topo_get_numa_node_number(self, handle: int) -> int:
        return 0

    def amdsmi_get_gpu_compute_partition(self, handle: int) -> str:
        return self.processors[handle][0].mode

    def amdsmi_get_energy_count(self, handle: int) -> dict:
        board = self.processors[handle][0]
        if board.second_die:
            return {"energy_accumulator": 0, "counter_resolution": board.resolution_uj,
                    "timestamp": 0}
        if not board.energy:
            raise AmdSmiLibraryException(2)
        elapsed_ns = self.clock() - self.t0_ns
        updated_ns = elapsed_ns - elapsed_ns % round(self.period_s * 1e9)
        count = board.start + int(board.power_w * updated_ns / 1e9 / (board.resolution_uj / 1e6))
        if elapsed_ns > board.back_after_s * 1e9:
            count -= board.back_by
        return {"energy_accumulator": count % (1 << board.width),
                "counter_resolution": board.resolution_uj, "timestamp": updated_ns}

    def amdsmi_get_power_info(self, handle: int) -> dict:
        board = self.processors[handle][0]
        if board.second_die:
            return {"current_socket_power": "N/A", "average_socket_power": "N/A"}
        power = int(board.power_w)
        return {"current_socket_power": power, "average_socket_power": power}
