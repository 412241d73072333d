"""The energy components a request's energy is broken into, in one fixed order.

Every array of per-component joules in this package is indexed by `COMPONENTS`; the response's
`usage.energy.breakdown` has exactly these keys and sums to `usage.energy.joules`.
"""

from __future__ import annotations

from typing import Final

COMPONENTS: Final[tuple[str, ...]] = (
    "embedding",   # token embedding lookup
    "attention",   # QKV/O projections, rotary, attention over the context
    "mlp",         # feed-forward block
    "norm",        # every RMSNorm/LayerNorm, including the final one
    "logits",      # LM head and logits processing for the sampled rows
    "allreduce",   # tensor-parallel all-reduce transfers
    "p2p",         # pipeline-parallel point-to-point sends between stages
    "allgather",   # all-gathers: the TP vocab-parallel logits gather, the DP tail
    "alltoall",    # expert-parallel all-to-all: MoE dispatch of tokens and combine of outputs
    "sync_wait",   # ranks idle at a collective, waiting for the slowest rank
    "static",      # static/idle power of the devices over the step's wall time
)
N_COMPONENTS: Final[int] = len(COMPONENTS)
INDEX: Final[dict[str, int]] = {name: i for i, name in enumerate(COMPONENTS)}
STATIC: Final[int] = INDEX["static"]
