"""The GPU check: the plugin's GPU parts against a real GPU, in one run of a few minutes.

`scripts/gpu-check.sh` runs it (`scripts/gpu_check.py`); docs/gpu-validation.md says what each
section measures and holds each real run's results. Six sections, each in a process of its own
with a time budget, each writing its JSON (figures and pass criteria) as soon as it ends:

1. `environment`: driver, CUDA, the GPU as NVML and torch describe it, versions.
2. `nvml`: the NVML meter and its device mapping, the counter against power samples, idle
   power, the profile picked for the GPU, the generic profile, `python -m vllm_piep.meters`.
3. `step_clock`: the CUDA-event step clock against wall time, queued steps, pickling, host cost.
4. `prior`: the prior's prediction against the GPU's own energy counter on random-weight models
   of real shapes (Llama-3.1-8B, Qwen3-30B-A3B), and this GPU's powers fitted from the rows.
5. `measured`: measured mode (the engine-core accountant and meter thread) on the real counter,
   fed real model steps timed by CUDA events.
6. `kernels`: `kernels_trace` on a torch.profiler trace of real decode steps.

No vLLM: the check uses the package's modules that run without it. With `--dry-run` the same
code runs on a CPU against stand-ins at the seams (`pynvml`, `torch.cuda`'s events), so that the
test suite keeps it working before a GPU is at hand; a dry run's figures are the stand-ins'.
"""
