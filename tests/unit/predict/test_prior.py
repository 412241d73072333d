"""The analytic prior and its device profiles."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from vllm_piep.meters.common import Source as MeterSource
from vllm_piep.model.components import INDEX, STATIC
from vllm_piep.model.devices import (
    GPU_SPECS,
    PROFILES,
    PROFILES_FILE,
    DeviceProfile,
    GpuFacts,
    UnknownDevice,
    cpu_spec,
    generic_gpu_spec,
    gpu_profile_key,
    load_profiles,
    read_idle_share,
    resolve_spec,
)
from vllm_piep.model.flops import ModelShape, StepBatch, step_work
from vllm_piep.predict.attribution import split_step
from vllm_piep.predict.base import Predictor, StepInput
from vllm_piep.predict.prior import PriorPredictor

SHAPE = ModelShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                   head_dim=128, vocab=128256, dtype_bytes=2)


def prior(shape: ModelShape = SHAPE, profile: str = "a100-sxm4-40gb") -> PriorPredictor:
    return PriorPredictor(shape, DeviceProfile.from_spec(GPU_SPECS[profile], shape.dtype_bytes))


def decode_step(n: int, context: int = 100, seconds: float = 0.02) -> StepInput:
    return StepInput(StepBatch.from_lists([0] * n, [1] * n, [context] * n, [1] * n), seconds)


def test_prior_is_a_predictor() -> None:
    p = prior()
    assert isinstance(p, Predictor)
    assert p.source == "prior" and p.bundle_id == "prior/a100-sxm4-40gb"


@pytest.mark.parametrize("profile", ["a100-sxm4-40gb", "h100-sxm5-80gb"])
@pytest.mark.parametrize("seconds", [0.02, 2.0])
def test_energy_is_idle_plus_busy_power_plus_the_roofline_sum(profile: str,
                                                              seconds: float) -> None:
    p = prior(profile=profile)
    step = decode_step(4, seconds=seconds)
    energy = p.predict_step(step)
    work = step_work(SHAPE, step.batch)
    prof = p.profile
    roofline = (prof.joules_per_flop * work.flops + prof.joules_per_byte * work.mem_bytes
                + prof.joules_per_link_byte * work.link_bytes).sum(axis=0)
    roofline[STATIC] = 0.0
    # Busy GPU-seconds: the step's work at peak rates / eta, at most the step's time.
    at_peak = (prof.seconds_per_flop * work.flops.sum()
               + prof.seconds_per_byte * (work.mem_bytes.sum() + 2 * work.link_bytes.sum())
               + prof.seconds_per_link_byte * work.link_bytes.sum())
    busy = min(seconds, at_peak / prof.eta)
    busy_j = busy * (prof.run_watts + prof.occupancy_watts * 4 / (4 + prof.n_half))
    assert prof.run_watts > 0 and 0 < busy_j
    expected = roofline * (1 + busy_j / roofline.sum())
    np.testing.assert_allclose(np.delete(energy.joules, STATIC), np.delete(expected, STATIC),
                               rtol=1e-9)
    assert energy.joules[STATIC] == pytest.approx(prof.idle_watts * 1 * seconds)
    assert energy.joules[INDEX["sync_wait"]] == 0


def _at_peak(p: PriorPredictor, batch: StepBatch) -> float:
    """A step's GPU-seconds at the profile's peak rates (`devices` docstring)."""
    work, prof = step_work(p.shape, batch), p.profile
    return (prof.seconds_per_flop * work.flops.sum()
            + prof.seconds_per_byte * (work.mem_bytes.sum() + 2 * work.link_bytes.sum())
            + prof.seconds_per_link_byte * work.link_bytes.sum())


@pytest.mark.parametrize("profile", ["h100-sxm5-80gb", "b200", "mi300x", "l4"])
def test_a_step_busy_one_percent_of_its_time_costs_about_idle_power(profile: str) -> None:
    p = prior(profile=profile)
    batch = decode_step(1).batch
    seconds = _at_peak(p, batch) / p.profile.eta / 0.01  # kernels run 1 % of the step
    energy = p.predict_step(StepInput(batch, seconds)).joules.sum()
    idle = p.profile.idle_watts * seconds
    assert idle < energy <= 1.10 * idle


def test_a_step_of_no_time_is_priced_as_its_work_alone() -> None:
    p = prior(profile="h100-sxm5-80gb")
    batch = decode_step(8).batch
    energy = p.predict_step(StepInput(batch, 0.0)).joules
    work, prof = step_work(SHAPE, batch), p.profile
    roofline = (prof.joules_per_flop * work.flops + prof.joules_per_byte * work.mem_bytes
                + prof.joules_per_link_byte * work.link_bytes).sum(axis=0)
    assert energy[STATIC] == 0.0
    np.testing.assert_allclose(np.delete(energy, STATIC), np.delete(roofline, STATIC),
                               rtol=1e-12)


def test_a_prefill_and_a_decode_pay_in_proportion_to_their_work_above_the_idle_share() -> None:
    """One step: an 8k-token prefill and a one-token decode at context 1000. Each pays half of
    the idle energy; above it, their shares are in the ratio of their work's energy (what the
    prior without busy power gives them), the busy energy riding on the work."""
    profile = DeviceProfile.from_spec(GPU_SPECS["h100-sxm5-80gb"], SHAPE.dtype_bytes)
    with_busy = PriorPredictor(SHAPE, profile)
    work_only = PriorPredictor(SHAPE, replace(profile, run_watts=0.0, occupancy_watts=0.0))
    batch = StepBatch.from_lists([8192, 0], [0, 1], [0, 1000], [1, 1])
    seconds = _at_peak(with_busy, batch) / 0.6
    shares = split_step(with_busy.predict_step(StepInput(batch, seconds)))
    work = split_step(work_only.predict_step(StepInput(batch, seconds)))
    idle = profile.idle_watts * seconds / 2
    np.testing.assert_allclose(shares[:, STATIC], [idle, idle], rtol=1e-12)
    above = np.delete(shares, STATIC, axis=1).sum(axis=1)
    by_work = np.delete(work, STATIC, axis=1).sum(axis=1)
    assert above[1] / above[0] == pytest.approx(by_work[1] / by_work[0], rel=1e-9)
    assert above.sum() > by_work.sum()  # the busy energy is on top of the work's
    assert shares[1].sum() < 0.2 * shares[0].sum()  # the decode pays far less


def test_static_power_counts_every_gpu_rank_but_one_cpu() -> None:
    step = decode_step(2, seconds=0.5)
    tp4 = prior(replace(SHAPE, tp=4)).predict_step(step)
    assert tp4.joules[STATIC] == pytest.approx(4 * prior().profile.static_watts * 0.5)
    assert tp4.joules[INDEX["allreduce"]] > 0 and tp4.joules[INDEX["allgather"]] > 0
    cpu = PriorPredictor(replace(SHAPE, tp=2, dtype_bytes=4),
                         DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    assert cpu.predict_step(step).joules[STATIC] == pytest.approx(cpu.profile.static_watts * 0.5)


def test_more_tokens_cost_more_and_split_follows_work() -> None:
    p = prior()
    small = p.predict_step(decode_step(1)).joules.sum()
    big = p.predict_step(decode_step(32)).joules.sum()
    assert big > small
    step = StepInput(StepBatch.from_lists([512, 0], [0, 1], [0, 50], [1, 1]), 0.05)
    per_request = split_step(p.predict_step(step))
    dynamic = np.delete(per_request, STATIC, axis=1).sum(axis=1)
    assert dynamic[0] > 10 * dynamic[1]  # the prefill did far more work
    # Static energy by time share: both requests held the device for the whole step.
    assert per_request[0, STATIC] == pytest.approx(per_request[1, STATIC], rel=1e-12)
    assert per_request[0, INDEX["logits"]] == pytest.approx(per_request[1, INDEX["logits"]])


def test_a_prior_whose_powers_are_transferred_says_so_in_its_bundle_id() -> None:
    assert prior(profile="a100-sxm4-40gb").bundle_id == "prior/a100-sxm4-40gb"  # fitted
    assert prior(profile="mi300x").bundle_id == (
        "prior/mi300x (powers transferred from h100-sxm5-80gb)")


@pytest.mark.parametrize("meter,kind,source,fit", [
    ("nvml", "measured", "calibrated", "+meter-fit(3.04,25.3)"),
    ("cpu-estimate", "estimated", "estimated", "+fit-to-cpu-estimate(3.04,25.3)"),
    ("simulated", "simulated", "simulated", "+fit-to-simulated(3.04,25.3)"),
])
def test_a_correction_says_what_its_meter_is(meter: str, kind: MeterSource, source: str,
                                             fit: str) -> None:
    """A prior fitted to an estimate or a simulator is that, not calibrated; its bundle id
    names the meter."""
    profile = DeviceProfile.from_spec(GPU_SPECS["a100-sxm4-40gb"], 2)
    corrected = PriorPredictor(SHAPE, profile, 3.04, 25.3, meter, kind)
    assert corrected.source == source
    assert corrected.bundle_id == "prior/a100-sxm4-40gb" + fit


def test_h100_is_more_efficient_per_flop_than_a100() -> None:
    a100 = DeviceProfile.from_spec(GPU_SPECS["a100-sxm4-40gb"], 2)
    h100 = DeviceProfile.from_spec(GPU_SPECS["h100-sxm5-80gb"], 2)
    assert h100.joules_per_flop < a100.joules_per_flop
    fp32 = DeviceProfile.from_spec(GPU_SPECS["a100-sxm4-40gb"], 4)
    assert fp32.joules_per_flop > a100.joules_per_flop  # FP32 runs off the tensor cores


# Device names exactly as CUDA (`torch.cuda.get_device_name`) and NVML (`nvidia-smi
# --query-gpu=name`) report them, as pasted in public issue threads and logs (docs/devices.md
# lists where each was seen), and the profile each must get.
REPORTED_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100-sxm5-80gb",
    "NVIDIA H100 PCIe": "h100-pcie-80gb",
    "NVIDIA H100 NVL": "h100-nvl-94gb",
    "NVIDIA H200": "h200-sxm-141gb",
    "NVIDIA H200 NVL": "h200-nvl-141gb",
    "NVIDIA GH200 480GB": "gh200-96gb",
    "NVIDIA GH200 144G HBM3e": "gh200-144gb",
    "NVIDIA B200": "b200",
    "NVIDIA GB200": "gb200",
    "NVIDIA A100-SXM4-40GB": "a100-sxm4-40gb",
    "A100-SXM4-40GB": "a100-sxm4-40gb",  # drivers before R470 drop the "NVIDIA " prefix
    "NVIDIA A100-SXM4-80GB": "a100-sxm4-80gb",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
    "NVIDIA L40S": "l40s",
    "NVIDIA L40": "l40",
    "NVIDIA L4": "l4",
    "NVIDIA A10G": "a10g",
    "NVIDIA A10": "a10",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "NVIDIA RTX 6000 Ada Generation": "rtx-6000-ada",
    "NVIDIA RTX A6000": "rtx-a6000",
    "Tesla V100-SXM2-16GB": "v100-sxm2",
    "Tesla V100-SXM2-32GB": "v100-sxm2",
    "Tesla V100-PCIE-16GB": "v100-pcie",
    "Tesla T4": "t4",
    # AMD: torch and rocminfo (HIP's marketing name, from libdrm's amdgpu.ids), AMD SMI's
    # market name (ROCm 6.3 and older hard-coded "MI300X-O"), vLLM's `get_device_name` on ROCm
    # (by PCI device ID: "AMD_Instinct_MI300X"), and the SR-IOV virtual functions ("VF").
    "AMD Instinct MI300X": "mi300x",
    "AMD_Instinct_MI300X": "mi300x",
    "MI300X-O": "mi300x",
    "AMD Instinct MI300X VF": "mi300x",
    "AMD Instinct MI300X HF": "mi300x",
    "AMD_Instinct_MI300X_HF": "mi300x",
    "AMD Instinct MI325X": "mi325x",
    "AMD_Instinct_MI325X": "mi325x",
    "AMD Instinct MI325X VF": "mi325x",
    "AMD Instinct MI350X": "mi350x",
    "AMD_Instinct_MI350X": "mi350x",
    "AMD Instinct MI355X": "mi355x",
    "AMD_Instinct_MI355X": "mi355x",
    "AMD Instinct MI250X / MI250": "mi250x-gcd",
    "AMD Instinct MI250X/MI250": "mi250x-gcd",
    "AMD Instinct MI250X": "mi250x-gcd",
    "AMD Instinct MI210": "mi210",
    # A MIG instance is named after its GPU; the profile is the GPU's.
    "NVIDIA A100-SXM4-40GB MIG 1g.5gb": "a100-sxm4-40gb",
    "NVIDIA H100 80GB HBM3 MIG 3g.40gb": "h100-sxm5-80gb",
}


@pytest.mark.parametrize(("device_name", "expected"), REPORTED_NAMES.items(),
                         ids=REPORTED_NAMES.keys())
def test_reported_gpu_names_resolve_to_their_own_profile(device_name: str,
                                                         expected: str) -> None:
    assert resolve_spec("auto", "cuda", device_name).name == expected


# Names real devices report that no profile describes: another chip (MI308X, MI300A, Radeon),
# or HIP's fallback when libdrm lacks the device ID. These get the generic profile.
UNPROFILED_NAMES = ["AMD_Instinct_MI308X", "AMD_Instinct_MI300A", "AMD Radeon Graphics",
                    "AMD_Radeon_RX7900XTX", "NVIDIA RTX PRO 6000 Blackwell Server Edition"]


@pytest.mark.parametrize("device_name", UNPROFILED_NAMES)
def test_names_of_other_chips_match_no_profile(device_name: str) -> None:
    assert gpu_profile_key(device_name) is None


def test_every_profile_is_reachable_from_a_reported_name_and_names_its_source() -> None:
    assert set(REPORTED_NAMES.values()) == set(GPU_SPECS)
    for spec in GPU_SPECS.values():
        assert any(doc in spec.source for doc in ("datasheet", "data sheet", "whitepaper",
                                                  "documentation")), spec.name
        assert 0 < spec.static_watts < spec.tdp_watts
        assert spec.peak_flops_16bit > spec.peak_flops_fp32 > 0
        if spec.peak_flops_fp8 is not None:  # Hopper, Ada, Blackwell, CDNA 3 and 4 double it
            # (to the datasheets' rounding: the L40S's prints 362.05 and 733 TFLOPS dense)
            assert spec.peak_flops_fp8 == pytest.approx(2 * spec.peak_flops_16bit, rel=0.015)


def test_the_docs_table_and_the_readme_count_match_the_data_file() -> None:
    root = Path(__file__).resolve().parents[3]
    rows = {}
    for line in (root / "docs" / "devices.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 9 and cells[0].startswith("`") and cells[2][:1].isdigit():
            rows[cells[0].strip("`")] = cells[2:]
    assert list(rows) == list(GPU_SPECS)
    for name, spec in GPU_SPECS.items():
        fp8 = "—" if spec.peak_flops_fp8 is None else f"{spec.peak_flops_fp8 / 1e12:g}"
        assert rows[name] == [f"{spec.tdp_watts:g}", f"{round(spec.static_watts, 2):g}",
                              f"{spec.peak_flops_16bit / 1e12:g}", fp8,
                              f"{spec.peak_flops_fp32 / 1e12:g}",
                              f"{spec.mem_bandwidth / 1e9:g}",
                              f"{spec.link_bandwidth / 1e9:g}"], name
    amd = sum("gfx_target" in entry for entry in PROFILES.raw.values())
    readme = (root / "README.md").read_text()
    assert f"| {len(GPU_SPECS) - amd}, else from NVML |" in readme
    assert f"| {amd}, else from AMD SMI |" in readme


def test_a_profile_file_with_a_typo_is_refused(tmp_path: Path) -> None:
    good = PROFILES_FILE.read_text()
    typo = tmp_path / "typo.toml"
    typo.write_text(good.replace("board_watts = 750", "board_wats = 750", 1))
    with pytest.raises(ValueError, match=r"typo.toml: profile 'mi300x' has unknown entries "
                                         r"\['board_wats'\]"):
        load_profiles(typo)
    dangling = tmp_path / "dangling.toml"
    dangling.write_text(good.replace('"mi355x"],', '"mi365x"],', 1))
    with pytest.raises(ValueError, match=r"names match profiles it does not define: "
                                         r"\['mi365x'\]"):
        load_profiles(dangling)


@pytest.mark.parametrize("field", ["idle_watts", "memory_gb_s", "memory", "source"])
def test_a_profile_without_a_constant_the_prior_needs_is_refused(tmp_path: Path,
                                                                 field: str) -> None:
    good = PROFILES_FILE.read_text()
    start = good.index("[profiles.l4]")
    end = good.index("\n[", start + 1)
    section = "\n".join(line for line in good[start:end].splitlines()
                        if not line.startswith(f"{field} ="))
    bad = tmp_path / "bad.toml"
    bad.write_text(good[:start] + section + good[end:])
    with pytest.raises(ValueError, match=rf"bad.toml: profile 'l4' lacks {field} "):
        load_profiles(bad)


def test_a_memory_type_without_its_energy_per_bit_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(PROFILES_FILE.read_text().replace('memory = "GDDR6X"', 'memory = "GDDR7"', 1))
    with pytest.raises(ValueError, match=r"profile 'rtx-4090' has memory 'GDDR7', not one of "
                                         r"\[memory_pj_per_bit\]"):
        load_profiles(bad)


def test_an_idle_power_outside_the_board_power_is_refused(tmp_path: Path) -> None:
    good = PROFILES_FILE.read_text()
    start = good.index("[profiles.l4]")
    end = good.index("\n[", start + 1)
    section = re.sub(r"idle_watts = \S+", "idle_watts = 72", good[start:end])
    bad = tmp_path / "bad.toml"
    bad.write_text(good[:start] + section + good[end:])
    with pytest.raises(ValueError, match=r"profile 'l4' has idle_watts 72, not between 0 and "
                                         r"its board_watts 72"):
        load_profiles(bad)


def test_every_idle_power_is_a_published_reading_or_the_median_share_of_those() -> None:
    read = {name: entry for name, entry in PROFILES.raw.items()
            if re.search(r"idle [^;:]*\((nvidia-smi|amd-smi|rocm-smi)", entry["source"])}
    share = float(np.median([e["idle_watts"] / e["board_watts"] for e in read.values()]))
    assert read_idle_share() == pytest.approx(share)
    assert len(read) > len(PROFILES.raw) / 2
    for name, entry in PROFILES.raw.items():
        if name in read:
            continue
        assert (f"idle {entry['idle_watts']} W: no published reading found, board power x "
                f"{100 * share:.1f} %, the median idle share") in entry["source"], name
        assert entry["idle_watts"] == round(entry["board_watts"] * share), name


def test_unknown_devices_and_profiles_are_refused_clearly() -> None:
    with pytest.raises(UnknownDevice, match="no device profile.*device_profile"):
        resolve_spec("auto", "cuda", "NVIDIA GeForce GT 710")
    with pytest.raises(ValueError, match="unknown device profile 'a200'.*a100-sxm4-40gb"):
        resolve_spec("a200", "cuda", None)
    assert resolve_spec("l4", "cpu", None).name == "l4"  # an explicit choice wins


# What NVML reports for three GPUs that have datasheet profiles (power limit mW, memory bus
# bits, max memory and SM clocks MHz, CUDA cores, compute capability): a generic profile built
# from it must land near the datasheet one.
NVML_FACTS = {
    "a100-sxm4-40gb": GpuFacts("NVIDIA A100-SXM4-40GB", 400, 5120, 1215, 1410, 6912, (8, 0),
                               (4, 16)),
    "h100-sxm5-80gb": GpuFacts("NVIDIA H100 80GB HBM3", 700, 5120, 2619, 1980, 16896, (9, 0),
                               (5, 16)),
    "l4": GpuFacts("NVIDIA L4", 72, 192, 6251, 2040, 7424, (8, 9), (4, 16)),
    "rtx-4090": GpuFacts("NVIDIA GeForce RTX 4090", 450, 384, 10501, 2520, 16384, (8, 9),
                         (4, 16)),
}


@pytest.mark.parametrize("key", NVML_FACTS)
def test_generic_profile_from_nvml_is_close_to_the_datasheet(key: str) -> None:
    generic, datasheet = generic_gpu_spec(NVML_FACTS[key]), GPU_SPECS[key]
    assert generic.name == f"generic/{NVML_FACTS[key].name}"
    for field in ("tdp_watts", "mem_bandwidth", "peak_flops_fp32"):
        assert getattr(generic, field) == pytest.approx(getattr(datasheet, field), rel=0.02)
    # Boost clocks above the datasheet's tensor clock: within 10 %.
    assert generic.peak_flops_16bit == pytest.approx(datasheet.peak_flops_16bit, rel=0.1)
    assert "median of the known profiles" not in generic.source


def test_generic_profile_without_nvml_says_which_figures_are_medians() -> None:
    spec = generic_gpu_spec(GpuFacts("NVIDIA H20"))
    assert spec.name == "generic/NVIDIA H20"
    assert spec.tdp_watts == pytest.approx(float(np.median([s.tdp_watts
                                                            for s in GPU_SPECS.values()])))
    assert "median of the known profiles for: board power, memory bandwidth" in spec.source
    assert spec.static_watts == pytest.approx(spec.tdp_watts * read_idle_share())
    assert f"idle {read_idle_share():.1%} of board power, the median idle share" in spec.source


AMD_PROFILES = [name for name, entry in PROFILES.raw.items() if "gfx_target" in entry]


@pytest.mark.parametrize("key", AMD_PROFILES)
def test_amd_datasheet_rates_are_units_times_clock_times_the_targets_rate(key: str) -> None:
    entry = PROFILES.raw[key]
    rates = PROFILES.per_cu_clock[entry["gfx_target"]]
    units_hz = entry["compute_units"] * entry["engine_mhz"] * 1e6  # printed to 4 figures
    assert units_hz * rates["matrix_16bit"] == pytest.approx(entry["bf16_tflops"] * 1e12,
                                                             rel=2e-3)
    assert units_hz * rates["fp32"] == pytest.approx(entry["fp32_tflops"] * 1e12, rel=2e-3)


# What AMD SMI reports for an MI300X (power cap in W after the µW conversion, compute units,
# peak GFX clock, graphics target, `vram_max_bandwidth`, PCIe): the generic profile lands on
# the datasheet's, so a name no pattern knows (HIP's "AMD Radeon Graphics" fallback) still gets
# the device's own figures.
AMD_SMI_MI300X = GpuFacts("AMD Radeon Graphics", power_limit_w=750, sm_clock_mhz=2100,
                          pcie=(5, 16), vendor="amd", compute_units=304,
                          gfx_target="gfx942:sramecc+:xnack-", mem_bandwidth_gb_s=5300)


def test_generic_profile_from_amd_smi_matches_the_datasheet() -> None:
    generic, datasheet = generic_gpu_spec(AMD_SMI_MI300X), GPU_SPECS["mi300x"]
    for field in ("tdp_watts", "mem_bandwidth", "peak_flops_fp32", "peak_flops_16bit"):
        assert getattr(generic, field) == pytest.approx(getattr(datasheet, field), rel=1e-3)
    assert "AMD SMI" in generic.source and "median of the known profiles" not in generic.source


def test_generic_amd_profile_of_an_unknown_target_says_which_figures_are_medians() -> None:
    spec = generic_gpu_spec(GpuFacts("AMD Instinct MI400", power_limit_w=1800, vendor="amd",
                                     compute_units=320, sm_clock_mhz=2500,
                                     gfx_target="gfx1250"))
    assert spec.tdp_watts == 1800
    assert ("median of the known profiles for: memory bandwidth, FP32 rate, 16-bit matrix "
            "rate, link bandwidth") in spec.source


def test_cpu_spec_reads_vector_width_and_clock() -> None:
    avx512 = cpu_spec(cores=4, cpuinfo={"flags": "fma avx2 avx512f", "cpu MHz": "3000",
                                        "model name": "Test CPU"})
    avx2 = cpu_spec(cores=4, cpuinfo={"flags": "fma avx2", "cpu MHz": "3000"})
    assert avx512.peak_flops_fp32 == 2 * avx2.peak_flops_fp32 == 4 * 3e9 * 64
    assert avx512.name == "cpu-avx512-4c" and "Test CPU" in avx512.source
    assert avx512.tdp_watts == 40 and avx512.static_watts == pytest.approx(12)
    assert not avx512.one_device_per_rank
