"""Canonical feature names shared by every dataset, the trainer and the bundle manifest.

Units are in the names. A dataset fills what it knows; the rest stay NaN and the trainer uses
only the features present in every training row. PIE-P Table 1 and IrEne Table 1 are the source
of the list: resource features, execution features, model-structure features.
"""

from __future__ import annotations

from typing import Final

RESOURCE: Final[tuple[str, ...]] = (
    "cpu_util_pct",       # CPU utilization of the host, percent
    "mem_util_pct",       # host memory utilization, percent
    "gpu_util_pct",       # device (GPU) utilization, percent
    "gpu_mem_util_pct",   # device memory-controller utilization, percent
    "gpu_clock_mhz",      # SM clock
    "gpu_mem_clock_mhz",  # device memory clock
)
EXECUTION: Final[tuple[str, ...]] = (
    "batch_size",
    "seq_len",            # input tokens per sequence (IrEne); prompt length elsewhere
    "input_tokens",
    "output_tokens",
    "gflop",              # floating-point work of the node, 1e9 FLOP
    "mem_mib",            # bytes the node moves, MiB
    "time_s",             # measured execution time of the node
    "device_s",           # device-seconds: time_s x devices (the exposure energy scales with)
    "time_per_token_s",   # measured time per output token (serving datasets)
    "tokens_per_s",       # measured output-token throughput of the whole deployment
    "device_energy_j",    # what the device's own counter reports (NVML), joules
    "n_devices",
    "tp", "pp", "dp",
    "prefill_tokens",     # tokens computed as prompt (prefill) in the step (span datasets)
    "decode_tokens",      # tokens generated in the step, one per decoding request
    "context_tokens",     # cached tokens the step's requests attend to before the step
    "comm_mib",           # collective payload of the node's calls per rank, MiB (span datasets)
)
STRUCTURE: Final[tuple[str, ...]] = (
    "layers", "hidden_size", "ffn_size", "heads", "kv_heads", "head_dim", "vocab_size",
    "params_b", "active_params_b",
    "active_params_per_device_b",  # active parameters / (tp x pp)
    "logits_share",       # LM-head parameters / active parameters
    "kv_share",           # K (or V) projection width / hidden size: 1 for MHA, < 1 for GQA
    "comm_mib_per_token",  # collective payload per generated token, all devices (PIE-P tree)
)
# Runtime features recorded on several ranks (PIE-P): the plain name holds the mean across
# ranks, these the spread (population std), minimum and maximum.
RANK_STATS: Final[tuple[str, ...]] = ("std", "min", "max")
