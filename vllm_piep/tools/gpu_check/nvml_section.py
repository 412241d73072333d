"""Section 2: the NVML meter (`meters/nvml.py`), its device mapping (`meters/gpus.py`), the
counter against NVML's power samples, idle power, the GPU's profile and the generic one, and
`python -m vllm_piep.meters` around a command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

from vllm_piep.meters.gpus import CudaIdentity, NvmlGpu, gpu_facts, instance_gpus
from vllm_piep.meters.nvml import NvmlMeter
from vllm_piep.model.devices import GPU_SPECS, DeviceSpec, generic_gpu_spec, gpu_profile_key
from vllm_piep.tools.gpu_check.context import Context, maybe, nvml_call
from vllm_piep.tools.gpu_check.counter import CounterPoller
from vllm_piep.tools.gpu_check.report import SectionReport, SectionSkipped
from vllm_piep.tools.gpu_check.work import BackgroundLoad

POWER_AGREEMENT = 0.10  # counter watts against the mean power sample
IDLE_RANGE = (0.5, 2.0)  # measured idle power over the profile's idle figure
GENERIC_AGREEMENT = 0.20  # the generic profile against the datasheet one
PROFILE_AGREEMENT = 0.10  # the profile's board power and memory against NVML's
COMMAND_AGREEMENT = 0.05  # `python -m vllm_piep.meters` against the outer counter delta
ORDINAL_ROUTE = "ordinal, no CUDA_VISIBLE_DEVICES"


def require_whole_gpu(nvml: Any, handle: Any) -> None:
    """A MIG instance reads no energy of its own: the sections that need the counter skip."""
    mode = nvml_call(nvml, "nvmlDeviceGetMigMode", handle)
    if mode is not None and int(mode[0]) == 1:
        raise SectionSkipped("the GPU is in MIG mode: NVML reads energy for the whole board "
                             "only, which other instances share")


def expected_uuid(identity: CudaIdentity) -> str | None:
    if not identity.uuid:
        return None
    return identity.uuid if identity.uuid.startswith(("GPU-", "MIG-")) else "GPU-" + identity.uuid


def check_mapping(report: SectionReport, nvml: Any, identity: CudaIdentity) -> NvmlGpu:
    """CUDA device 0 found as the same NVML GPU by every route the meter takes."""
    uuid = expected_uuid(identity)
    report.figure("cuda_identity", {"uuid": uuid, "pci": identity.pci})
    if uuid is None:
        raise SectionSkipped("torch reports no UUID for CUDA device 0")
    uuids = [maybe(nvml.nvmlDeviceGetUUID, nvml.nvmlDeviceGetHandleByIndex(i))
             for i in range(int(nvml.nvmlDeviceGetCount()))]
    if not report.check("an NVML GPU has torch's UUID for CUDA device 0", uuids,
                        f"one of them is {uuid}", uuid in uuids):
        raise SectionSkipped(f"no NVML GPU has torch's UUID {uuid}: the meter cannot be checked")
    index = uuids.index(uuid)
    pci = nvml.nvmlDeviceGetPciInfo(nvml.nvmlDeviceGetHandleByIndex(index))
    nvml_pci = (int(pci.domain), int(pci.bus), int(pci.device))
    routes: dict[str, tuple[dict[int, CudaIdentity], dict[str, str]]] = {
        "identity (UUID, PCI from torch)": ({0: identity}, {}),
        ORDINAL_ROUTE: ({}, {}),
        "CUDA_VISIBLE_DEVICES index": ({}, {"CUDA_VISIBLE_DEVICES": str(index),
                                            "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
        "CUDA_VISIBLE_DEVICES full UUID": ({}, {"CUDA_VISIBLE_DEVICES": uuid}),
        "CUDA_VISIBLE_DEVICES abbreviated UUID": ({}, {"CUDA_VISIBLE_DEVICES": uuid[:12]}),
    }
    # The ordinal alone names the GPU only where this process sees every GPU in NVML's order.
    ordinal_holds = "CUDA_VISIBLE_DEVICES" not in os.environ and len(uuids) == 1
    found: dict[str, Any] = {}
    gpu = None
    for route, (identities, environ) in routes.items():
        try:
            gpus = instance_gpus(nvml, [0], identities, environ)
            got = gpus[0]
            found[route] = {"nvml_index": got.index, "uuid": got.uuid}
            ok = len(gpus) == 1 and got.index == index and got.uuid == uuid
            gpu = gpu or (got if ok else None)
        except Exception as exc:  # noqa: BLE001  (a failing route is the finding)
            found[route], ok = f"{type(exc).__name__}: {exc}", False
        gated = ok if route != ORDINAL_ROUTE or ordinal_holds else None
        report.check(f"CUDA device 0 maps to NVML GPU {index} by {route}", found[route],
                     f"NVML index {index}, {uuid}" + ("" if gated is not None or ok else
                     " (reported: this host has several GPUs or CUDA_VISIBLE_DEVICES)"), gated)
    pci_ok = identity.pci is None or identity.pci == nvml_pci
    report.check("torch's PCI address is NVML's for that UUID",
                 {"torch": identity.pci, "nvml": nvml_pci}, "equal", pci_ok)
    if gpu is None:
        raise SectionSkipped("no route found CUDA device 0's GPU: the meter cannot be checked")
    return gpu


def check_meter(report: SectionReport, identity: CudaIdentity) -> NvmlMeter:
    meter = NvmlMeter(cuda_devices=[0], identities={0: identity}, detect_s=2.0)
    meter.start()
    report.figure("meter_devices", [{"name": d.name, "note": d.note} for d in meter.devices()])
    report.check("the meter reads the energy counter, not power polling",
                 {"sampled_gpus": meter.sampled_gpus}, "no GPU polled", not meter.sampled_gpus)
    period = meter.resolution_s
    report.figure("counter_update_period_s", period)
    report.check("the counter's update period is detected", period,
                 f"two or more updates seen within the meter's {meter.detect_s:g} s detection",
                 0 < period < meter.detect_s)
    return meter


def check_load(ctx: Context, nvml: Any, handle: Any) -> float:
    """Counter watts against NVML's power samples over a matmul load; the load's watts."""
    scale, report = ctx.backend.scale, ctx.report
    burner = ctx.backend.burner(scale.matmul_n)
    with CounterPoller(nvml, handle, power=True) as poller, BackgroundLoad(burner) as load:
        start = time.perf_counter_ns() + int(scale.settle_s * 1e9)
        window = poller.window(start, scale.load_s - scale.settle_s, timeout_s=5.0)
    if load.error is not None:
        raise load.error
    sampled = poller.mean_power(window.start.t_ns, window.end.t_ns)
    report.figure("load", {"seconds": window.seconds, "joules": window.joules,
                           "counter_watts": window.watts, "power_sample_watts": sampled,
                           "power_samples": len([t for t, _ in poller.samples
                                                 if window.start.t_ns <= t <= window.end.t_ns]),
                           "matmul_tflops": 2 * scale.matmul_n ** 3 / burner.op_s / 1e12})
    ratio = window.watts / sampled
    report.check("counter watts agree with NVML's power samples under load", ratio,
                 f"counter / samples within 1 ± {POWER_AGREEMENT:g}",
                 abs(ratio - 1) <= POWER_AGREEMENT)
    return window.watts


def check_idle(ctx: Context, nvml: Any, handle: Any, spec: DeviceSpec | None) -> None:
    scale, report = ctx.backend.scale, ctx.report
    with CounterPoller(nvml, handle) as poller:
        window = poller.window(time.perf_counter_ns() + int(scale.settle_s * 1e9),
                               scale.idle_s, timeout_s=5.0)
    report.figure("idle", {"seconds": window.seconds, "watts": window.watts,
                           "profile_idle_watts": None if spec is None else spec.static_watts})
    if spec is None:
        report.check("idle power against the profile's idle figure", window.watts,
                     "a profile for this GPU", False)
        return
    ratio = window.watts / spec.static_watts
    low, high = IDLE_RANGE
    report.check("idle power against the profile's idle figure", ratio,
                 f"measured / profile within {low:g}-{high:g}", low <= ratio <= high)


def memory_in_name(key: str) -> float | None:
    """The memory size a profile's name states, in GiB (`h100-sxm5-80gb`: 80)."""
    match = re.search(r"(\d+)gb", key)
    return float(match.group(1)) if match else None


def check_profiles(report: SectionReport, nvml: Any, gpu: NvmlGpu) -> DeviceSpec | None:
    name = gpu.name
    key = gpu_profile_key(name)
    limit = nvml_call(nvml, "nvmlDeviceGetPowerManagementDefaultLimit", gpu.handle) or \
        nvml_call(nvml, "nvmlDeviceGetEnforcedPowerLimit", gpu.handle)
    memory = maybe(nvml.nvmlDeviceGetMemoryInfo, gpu.handle)
    facts = {"name": name, "profile": key,
             "default_power_limit_w": None if limit is None else float(limit) / 1000,
             "memory_gib": None if memory is None else int(memory.total) / 2**30}
    report.figure("profile", facts)
    if key is None:
        report.check("a datasheet profile fits NVML's name", name, "one of GPU_SPECS", False)
        return None
    spec = GPU_SPECS[key]
    named = memory_in_name(key)
    power_ok = (facts["default_power_limit_w"] is not None and
                abs(facts["default_power_limit_w"] / spec.tdp_watts - 1) <= PROFILE_AGREEMENT)
    memory_ok = named is None or (facts["memory_gib"] is not None and
                                  abs(facts["memory_gib"] / named - 1) <= PROFILE_AGREEMENT)
    report.check("the profile picked for the name is this GPU's (board power, memory)",
                 {"profile": key, "profile_tdp_w": spec.tdp_watts, "profile_memory_gb": named,
                  **facts}, f"NVML's default power limit and memory within "
                 f"{PROFILE_AGREEMENT:.0%} of the profile's", power_ok and memory_ok)
    generic = generic_gpu_spec(gpu_facts(nvml, gpu))
    figures = {"tdp_watts": (generic.tdp_watts, spec.tdp_watts),
               "peak_flops_16bit": (generic.peak_flops_16bit, spec.peak_flops_16bit),
               "mem_bandwidth": (generic.mem_bandwidth, spec.mem_bandwidth)}
    report.figure("generic_profile", {"source": generic.source,
                                      **{k: {"generic": g, "datasheet": d}
                                         for k, (g, d) in figures.items()}})
    for field, (got, want) in figures.items():
        report.check(f"the generic profile's {field} is the datasheet's",
                     got / want, f"generic / datasheet within 1 ± {GENERIC_AGREEMENT:g}",
                     abs(got / want - 1) <= GENERIC_AGREEMENT)
    return spec


def check_command(ctx: Context, nvml: Any, handle: Any) -> None:
    """`python -m vllm_piep.meters --json-file F -- CMD` against the counter read outside."""
    report = ctx.report
    mode = nvml_call(nvml, "nvmlDeviceGetComputeMode", handle)
    if mode not in (None, 0):  # NVML_COMPUTEMODE_DEFAULT
        report.check("python -m vllm_piep.meters reports the command's measured joules", mode,
                     "the GPU in compute mode 0 (another process may use it)", None)
        report.figure("meter_command_skipped", f"compute mode {mode}: this process holds the "
                      "GPU, a second one cannot run the command")
        return
    record_path = ctx.scratch / "meter-command.json"
    command = [sys.executable, "-m", "vllm_piep.meters", "--meter", "nvml", "--json-file",
               str(record_path), "--", *ctx.backend.matmul_command(ctx.backend.scale.command_s)]
    with CounterPoller(nvml, handle, poll_s=0.001) as poller:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                              env=os.environ.copy())
        time.sleep(0.2)  # a counter update after the command's end
    if done.returncode != 0 or not record_path.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        report.check("python -m vllm_piep.meters ran the command", done.returncode,
                     "exit 0 and a JSON record", False)
        report.figure("meter_command_error", tail[0])
        return
    record = json.loads(record_path.read_text())

    def wall_ns(text: str) -> int:
        return int(datetime.fromisoformat(text).timestamp() * 1e9)

    outer = (poller.value_at_wall(wall_ns(record["end"])) -
             poller.value_at_wall(wall_ns(record["start"]))) / 1000.0
    report.figure("meter_command", {"record": record, "outer_joules": outer})
    ratio = record["joules"] / outer if outer > 0 else float("nan")
    report.check("python -m vllm_piep.meters reports the command's measured joules",
                 {"source": record["source"], "meter": record["meter"],
                  "exit_code": record["exit_code"], "joules": record["joules"],
                  "outer_joules": outer, "ratio": ratio},
                 f"source measured, meter nvml, exit 0, joules / outer counter delta within "
                 f"1 ± {COMMAND_AGREEMENT:g}",
                 record["source"] == "measured" and record["meter"] == "nvml"
                 and record["exit_code"] == 0 and abs(ratio - 1) <= COMMAND_AGREEMENT)


def run(ctx: Context) -> None:
    identity = ctx.backend.identity(0)
    with ctx.nvml() as nvml:
        gpu = check_mapping(ctx.report, nvml, identity)
        require_whole_gpu(nvml, gpu.handle)
        meter = check_meter(ctx.report, identity)
        meter.stop()
        spec = check_profiles(ctx.report, nvml, gpu)
        check_load(ctx, nvml, gpu.handle)
        check_idle(ctx, nvml, gpu.handle, spec)
        check_command(ctx, nvml, gpu.handle)
