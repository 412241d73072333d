"""Meters behind one interface (`common.Meter`: cumulative joules per device, CLOCK_MONOTONIC
timestamps, measured or estimated):

- `nvml.NvmlMeter`: NVIDIA GPUs, the energy counter (Volta+) or integrated power polling;
- `rapl.RaplMeter`: Linux powercap (Intel and AMD package and DRAM domains);
- `external.ExternalLogMeter`: a wall meter's CSV of timestamped watts;
- `cpu_estimate.CpuEstimateMeter`: /proc/stat utilization times a TDP (an estimate);
- `simulated.SimulatedMeter`: a formula, for tests only (never chosen by `auto`);
- `common.CompositeMeter`: several together (GPU + CPU + DRAM = system).

`auto.auto_meter()` picks NVML (+ RAPL) else RAPL else the CPU estimate and says why;
`windows` gives the energy of span windows and PIE-P's repeated sampling;
`python -m vllm_piep.meters --meter auto --seconds 5` uses one on its own. Importing the
package imports no meter: import the module you need.
"""
