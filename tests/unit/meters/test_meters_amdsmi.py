"""The AMD SMI meter against a stand-in `amdsmi` (tests/support/standin_amdsmi.py), placed where
the real module is imported: the accumulator read as joules (32-bit wraps handled, a counter
that goes back refused), power polling where the accumulator is not supported (said in the
meter's name), a partitioned device metered whole once, and ROCm's visible-device variables.
The stand-in's accumulators, the meter's timestamps and its resolution detection run on a
fake clock that only the tests move: every joule expected is exact, to a count's rounding."""

from __future__ import annotations

import sys

import pytest
from support.fake_clock import FakeClock, install
from support.standin_amdsmi import Board, StandinAmdSmi

from vllm_piep.meters import amdsmi, polling
from vllm_piep.meters.amdsmi import AmdIdentity, AmdSmiMeter, visible_physical
from vllm_piep.meters.common import MeterError, NoMeter

FAST = {"detect_s": 0.05, "detect_poll_s": 0.0005, "poll_interval_s": 0.005}
COUNT_J = Board.resolution_uj / 1e6  # one count of the accumulator: what a reading rounds off


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    install(monkeypatch, fake, amdsmi, polling)
    return fake


def measured(meter: AmdSmiMeter, clock: FakeClock,
             seconds: float = 0.3) -> tuple[dict[str, float], float]:
    meter.start()
    first = meter.read()
    clock.advance(seconds)
    last = meter.read()
    meter.stop()
    return ({k: last.joules[k] - first.joules[k] for k in last.joules},
            (last.t_ns - first.t_ns) / 1e9)


def test_the_accumulator_gives_each_gpu_its_joules(clock: FakeClock) -> None:
    smi = StandinAmdSmi([Board("0000:0c:00.0", 300.0), Board("0000:22:00.0", 200.0)],
                        clock=clock)
    meter = AmdSmiMeter(amdsmi=smi, environ={}, **FAST)
    joules, seconds = measured(meter, clock)
    assert meter.name == "amdsmi" and meter.sampled_gpus == []
    assert seconds == 0.3
    assert joules["gpu0"] == pytest.approx(300.0 * 0.3, abs=COUNT_J)
    assert joules["gpu1"] == pytest.approx(200.0 * 0.3, abs=COUNT_J)
    assert meter.resolution_s == pytest.approx(0.001)  # the stand-in updates every millisecond
    assert smi.initialised == 0  # shut down on stop


def test_a_32_bit_accumulator_that_wraps_keeps_counting(clock: FakeClock) -> None:
    # 300 W at 15.3 µJ per count: about 20 M counts a second, so 2**32 - 2M wraps within the
    # 0.3 s measured (about 5.9 M counts), after the 4 ms the detection takes.
    board = Board("0000:0c:00.0", 300.0, width=32, start=(1 << 32) - 2_000_000)
    smi = StandinAmdSmi([board], clock=clock)
    meter = AmdSmiMeter(amdsmi=smi, environ={}, **FAST)
    meter.start()
    first = meter.read()
    assert smi.amdsmi_get_energy_count(0)["energy_accumulator"] > 1 << 31  # not wrapped yet
    clock.advance(0.3)
    assert smi.amdsmi_get_energy_count(0)["energy_accumulator"] < 1 << 31  # wrapped
    last = meter.read()
    meter.stop()
    assert last.joules["gpu0"] - first.joules["gpu0"] == pytest.approx(300.0 * 0.3,
                                                                       abs=COUNT_J)


def test_a_counter_that_goes_back_is_refused(clock: FakeClock) -> None:
    board = Board("0000:0c:00.0", 300.0, start=2 * 10**12, back_by=10**9, back_after_s=0.2)
    meter = AmdSmiMeter(amdsmi=StandinAmdSmi([board], clock=clock), environ={}, **FAST)
    meter.start()
    meter.read()
    clock.advance(0.19)
    meter.read()  # still counting up
    clock.advance(0.06)
    with pytest.raises(MeterError, match="went back"):
        meter.read()
    meter.stop()


def test_without_an_accumulator_the_power_is_polled_and_the_name_says_so(
        clock: FakeClock) -> None:
    smi = StandinAmdSmi([Board("0000:0c:00.0", 250.0, energy=False)], clock=clock)
    meter = AmdSmiMeter(amdsmi=smi, environ={}, **FAST)
    joules, seconds = measured(meter, clock)
    assert meter.name == "amdsmi-power" and meter.sampled_gpus == [0]
    # A constant power: the trapezoid is exact, whenever the sampler thread polled.
    assert seconds == 0.3 and joules["gpu0"] == pytest.approx(250.0 * 0.3, rel=1e-12)


def test_a_partitioned_device_is_metered_whole_once(clock: FakeClock) -> None:
    # MI300X in CPX mode: eight processors on one board; an instance using four of them.
    smi = StandinAmdSmi([Board("0000:0c:00.0", 400.0, partitions=8, mode="CPX"),
                         Board("0000:22:00.0", 100.0)], clock=clock)
    meter = AmdSmiMeter(hip_devices=[0, 1, 2, 3], amdsmi=smi, environ={}, **FAST)
    [device] = meter.devices()
    assert device.name == "gpu0" and "8 CPX partitions" in device.note
    joules, seconds = measured(meter, clock)
    assert list(joules) == ["gpu0"]
    assert seconds == 0.3 and joules["gpu0"] == pytest.approx(400.0 * 0.3, abs=COUNT_J)


def test_rocm_s_visible_device_variables_pick_the_physical_gpu() -> None:
    assert visible_physical(4, {}) == [0, 1, 2, 3]
    assert visible_physical(4, {"ROCR_VISIBLE_DEVICES": "1,2,3",
                                "HIP_VISIBLE_DEVICES": "2"}) == [3]
    assert visible_physical(4, {"CUDA_VISIBLE_DEVICES": "3,0"}) == [3, 0]
    assert visible_physical(4, {"HIP_VISIBLE_DEVICES": "1",
                                "CUDA_VISIBLE_DEVICES": "3"}) == [1]  # HIP's wins
    with pytest.raises(MeterError, match="HIP_VISIBLE_DEVICES"):
        visible_physical(2, {"HIP_VISIBLE_DEVICES": "5"})
    smi = StandinAmdSmi([Board(f"0000:{b:02x}:00.0", 100.0 * (b + 1)) for b in range(4)])
    meter = AmdSmiMeter(hip_devices=[0], amdsmi=smi, **FAST,
                        environ={"ROCR_VISIBLE_DEVICES": "1,2,3", "HIP_VISIBLE_DEVICES": "2"})
    assert [d.name for d in meter.devices()] == ["gpu3"]
    meter.stop()
    # With the devices' PCI addresses (a process where HIP runs), those decide.
    by_address = AmdSmiMeter(hip_devices=[0], amdsmi=smi, environ={}, **FAST,
                             identities={0: AmdIdentity((0, 2, 0))})
    assert [d.name for d in by_address.devices()] == ["gpu2"]
    by_address.stop()


def test_without_amdsmi_the_meter_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # an import that fails, as off ROCm
    with pytest.raises(NoMeter, match=r"^amdsmi: cannot import amdsmi") as caught:
        AmdSmiMeter(environ={})
    assert "\n" not in str(caught.value)
    assert AmdSmiMeter.available() is False


def test_auto_picks_amd_smi_where_nvml_is_absent_and_the_cli_names_it() -> None:
    from vllm_piep.meters.auto import auto_meter, make_meter

    smi = StandinAmdSmi([Board("0000:0c:00.0", 300.0)])
    meter, why = auto_meter(nvml_available=False, amd_available=True, rapl_root="/nonexistent",
                            amd_factory=lambda: AmdSmiMeter(amdsmi=smi, environ={}, **FAST))
    assert meter.name == "amdsmi" and why.startswith("AMD SMI measures the GPUs gpu0")
    meter.stop()
    named = make_meter("amdsmi", amdsmi=smi, environ={}, **FAST)
    assert isinstance(named, AmdSmiMeter)
    named.stop()
    # Off AMD (this machine): auto goes on to the next meter, as before.
    other, _ = auto_meter(nvml_available=False, rapl_root="/nonexistent")
    assert other.name != "amdsmi"


def test_an_mi250_module_is_metered_once_through_its_first_die(clock: FakeClock) -> None:
    # Two MI250X modules: each GCD a PCI device of its own; the second reports no power.
    name = "AMD Instinct MI250X / MI250"
    smi = StandinAmdSmi([Board("0000:29:00.0", 420.0, name=name),
                         Board("0000:2c:00.0", 0.0, name=name, second_die=True),
                         Board("0000:2f:00.0", 380.0, name=name),
                         Board("0000:32:00.0", 0.0, name=name, second_die=True)], clock=clock)
    both = AmdSmiMeter(hip_devices=[0, 1], amdsmi=smi, environ={}, **FAST)
    [device] = both.devices()
    assert device.name == "gpu0" and "both dies (GCDs)" in device.note
    joules, seconds = measured(both, clock)
    assert seconds == 0.3 and joules["gpu0"] == pytest.approx(420.0 * 0.3, abs=COUNT_J)
    # An instance on the second die alone is metered through the first: the module's energy.
    second = AmdSmiMeter(amdsmi=smi, **FAST, environ={"HIP_VISIBLE_DEVICES": "3"})
    assert [d.name for d in second.devices()] == ["gpu2"]
    joules, seconds = measured(second, clock)
    assert seconds == 0.3 and joules["gpu2"] == pytest.approx(380.0 * 0.3, abs=COUNT_J)
    # By PCI address too (torch gives the second die's).
    by_address = AmdSmiMeter(hip_devices=[0], amdsmi=smi, environ={}, **FAST,
                             identities={0: AmdIdentity((0, 0x2C, 0))})
    assert [d.name for d in by_address.devices()] == ["gpu0"]
    by_address.stop()


def test_a_second_die_that_reports_power_is_a_device_of_its_own() -> None:
    # A driver that meters each GCD: no pairing, each die its own joules.
    name = "AMD Instinct MI250X / MI250"
    smi = StandinAmdSmi([Board("0000:29:00.0", 200.0, name=name),
                         Board("0000:2c:00.0", 150.0, name=name)])
    meter = AmdSmiMeter(amdsmi=smi, environ={}, **FAST)
    assert [(d.name, d.note) for d in meter.devices()] == [("gpu0", ""), ("gpu1", "")]
    meter.stop()


def test_amd_smi_facts_are_read_in_its_units_for_the_visible_device() -> None:
    from vllm_piep.meters.amdsmi import amd_gpu_facts, first_instance_amd_facts

    smi = StandinAmdSmi([Board("0000:0c:00.0", 100.0),
                         Board("0000:22:00.0", 100.0, name="AMD Instinct MI308X", cap_w=650,
                               compute_units=80, vram_gb_s="N/A")])
    facts = first_instance_amd_facts(0, amdsmi=smi, environ={"HIP_VISIBLE_DEVICES": "1"})
    assert facts == amd_gpu_facts(smi, 1)
    assert (facts.name, facts.vendor, facts.power_limit_w, facts.compute_units,
            facts.sm_clock_mhz, facts.gfx_target, facts.mem_bandwidth_gb_s, facts.pcie) == (
        "AMD Instinct MI308X", "amd", 650.0, 80, 2100.0, "gfx942", None, (5, 16))
    assert smi.initialised == 0
    with pytest.raises(MeterError, match="HIP device 2 out of range; 2 visible"):
        first_instance_amd_facts(2, amdsmi=smi, environ={})


def test_without_nvml_the_engine_describes_an_amd_gpu_through_amd_smi(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_piep.meters.device_facts import instance_gpu_facts

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", StandinAmdSmi([Board("0000:0c:00.0")]))
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert instance_gpu_facts(0).vendor == "amd"
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    with pytest.raises(MeterError, match=r"^nvml: cannot import pynvml.*; amdsmi: cannot "
                                         r"import amdsmi"):
        instance_gpu_facts(0)


def test_the_served_meter_takes_hip_ordinals_or_physical_device_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_piep.meters.factory import meter_factory

    smi = StandinAmdSmi([Board(f"0000:{b:02x}:00.0", 100.0) for b in range(4)])
    monkeypatch.setitem(sys.modules, "amdsmi", smi)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "2,3")
    by_ordinal, _ = meter_factory("amdsmi", [1])
    meter = by_ordinal()
    assert [d.name for d in meter.devices()] == ["gpu3"]  # HIP device 1 of "2,3"
    meter.stop()
    by_id, _ = meter_factory("amdsmi", nvml_indices=[1])  # vLLM's --device-ids: physical
    meter = by_id()
    assert [d.name for d in meter.devices()] == ["gpu1"]
    meter.stop()
