"""What the names in a trace mean: collective op names, backend kernels and works, dtypes.

Names as they appear in real traces (torch 2.13, CPU, gloo; checked by tests/test_kernels_trace.py):

- caller side, on the thread that called `torch.distributed`: `cpu_op` events `c10d::allreduce_`,
  `c10d::_allgather_base_`, `c10d::allgather_`, `c10d::_reduce_scatter_base_`,
  `c10d::reduce_scatter_`, `c10d::broadcast_`, `c10d::reduce_`, `c10d::gather_`,
  `c10d::scatter_`, `c10d::alltoall_base_`, `c10d::barrier`, `c10d::send`, `c10d::recv_`. They
  only post the work for collectives (tens of microseconds); their `Concrete Inputs` hold the
  `async_op` flag and, for send/recv, the peer's rank in the group.
- gloo's work, `user_annotation` events named `gloo:all_reduce`, `gloo:all_gather`,
  `gloo:broadcast`, `gloo:reduce`, `gloo:gather`, `gloo:scatter`, `gloo:all_to_all`,
  `gloo:barrier` on gloo's worker threads (`pt_gloo_runloop`), spanning from the worker picking
  the work up to its completion (waiting for peers included); `gloo:send`, `gloo:recv` on the
  calling thread, from posting to completion. gloo emulates reduce-scatter with all-reduces
  (`c10d::_reduce_scatter_base_` runs one `gloo:all_reduce`, `c10d::reduce_scatter_` several).
  `Input type`/`Input Dims` (with `record_shapes=True`) give the dtype and size.
- vLLM's CPU shared-memory communicator: `cpu_op` events `_C::shm_allreduce`,
  `_C::shm_all_gather`, `_C::shm_gather`, `_C::shm_send_tensor_list`,
  `_C::shm_recv_tensor_list` (synchronous; the handle is the first argument).
- NCCL on GPU: `kernel` events `ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)` (NCCL >= 2.19),
  `ncclKernel_AllReduce_RING_LL_Sum_float(...)` (older), `ncclDevKernel_SendRecv(...)`,
  `ncclDevKernel_Generic(...)`; Kineto copies the `record_param_comms` metadata onto the kernel
  (`Collective name`, `In msg nelems`, `dtype`, `Group size`, `Process Group Name`,
  `Process Group Ranks`, `Src Rank`/`Dst Rank`, `Seq`). vLLM's custom all-reduce kernels
  `cross_device_reduce_1stage`/`_2stage` count as all-reduces.
"""

from __future__ import annotations

import re

P2P = frozenset({"send", "recv"})

# Canonical op names, from the names with underscores, namespaces and variants removed.
_OPS = {
    "allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
    "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "alltoall": "all_to_all", "alltoallv": "all_to_all", "barrier": "barrier",
    "monitoredbarrier": "barrier", "send": "send", "recv": "recv", "recvanysource": "recv",
    "sendtensorlist": "send", "recvtensorlist": "recv", "sendrecv": "send_recv",
}
_VARIANTS = ("coalesced", "intotensor", "tensor", "base", "single")


def canonical_op(name: str) -> str | None:
    """`all_reduce`, `all_gather`, ... for a collective's name in any spelling (`allreduce_`,
    `_allgather_base_`, `reduce_scatter_tensor_coalesced`, `AllReduce`, `all_to_allv`), or None
    when the name is no collective."""
    key = name.rsplit("::", 1)[-1].rsplit(":", 1)[-1].lower().replace("_", "")
    key = key.removeprefix("shm")
    stripped = True
    while key not in _OPS and stripped:  # a name may carry several variant suffixes
        stripped = False
        for suffix in _VARIANTS:
            if key.endswith(suffix) and len(key) > len(suffix):
                key, stripped = key[: -len(suffix)], True
                break
    return _OPS.get(key)


# --- caller-side ops -----------------------------------------------------------------------

def c10d_op(name: str) -> str | None:
    """The canonical op of a `c10d::` dispatcher op (the caller side of any backend)."""
    if not name.startswith("c10d::"):
        return None
    return canonical_op(name[len("c10d::"):])


# vLLM CPU shared-memory ops: argument layout from their schemas, e.g.
# `shm_allreduce(int handle, Tensor! data)`, `shm_send_tensor_list(int handle, Tensor[] list,
# int dst)`, `shm_recv_tensor_list(int handle, int src) -> Tensor[]`.
_SHM = re.compile(r"(?:^|::)shm_(allreduce|all_gather|gather|send_tensor_list|recv_tensor_list)$")
SHM_PEER_ARG = {"send": 2, "recv": 1}
SHM_DATA_ARG = 1


def shm_op(name: str) -> str | None:
    match = _SHM.search(name)
    return canonical_op(match.group(1)) if match else None


# --- backend works -------------------------------------------------------------------------

def gloo_op(name: str) -> str | None:
    """The op of one of gloo's own ranges (`gloo:all_reduce`, `gloo:recvAnySource`)."""
    if not name.startswith("gloo:"):
        return None
    return canonical_op(name[len("gloo:"):])


# Which caller-side ops a gloo work can belong to (gloo runs reduce-scatter as all-reduces).
GLOO_SERVES = {"all_reduce": frozenset({"all_reduce", "reduce_scatter"})}


def gloo_serves(work_op: str, caller_op: str) -> bool:
    return caller_op in GLOO_SERVES.get(work_op, frozenset({work_op}))


_NCCL = (
    re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)"),  # ncclDevKernel_AllReduce_..., ncclKernel_...
    re.compile(r"^nccl([A-Z][A-Za-z]*?)(?:Ring|Tree|CollNet|NVLS|PAT)\w*Kernel"),  # NCCL 2.4-2.7
)
_VLLM_CUSTOM_AR = re.compile(r"cross_device_reduce_\dstage")


def nccl_kernel(name: str) -> str | None:
    """For a GPU kernel's name: the canonical op if it is an NCCL (or vLLM custom all-reduce)
    kernel, `nccl` for NCCL's generic kernels whose op only the metadata tells, else None."""
    for pattern in _NCCL:
        match = pattern.match(name)
        if match:
            word = match.group(1)
            if word.lower() == "generic":
                return "nccl"
            return canonical_op(word) or "nccl"
    if _VLLM_CUSTOM_AR.search(name):
        return "all_reduce"
    return None


# --- dtypes --------------------------------------------------------------------------------

# (canonical name, bytes per element) for every spelling seen in traces: caffe2 type names in
# Kineto's `Input type`, ScalarType names in `record_param_comms`' `dtype`, and the type tokens
# of NCCL kernel names.
_DTYPES: dict[str, tuple[str, int]] = {}


def _add(canonical: str, size: int, *spellings: str) -> None:
    for spelling in (canonical, *spellings):
        _DTYPES[spelling] = (canonical, size)


_add("float32", 4, "float", "Float", "f32", "torch.float32")
_add("float64", 8, "double", "Double", "f64", "torch.float64")
_add("float16", 2, "c10::Half", "Half", "half", "f16", "torch.float16")
_add("bfloat16", 2, "c10::BFloat16", "BFloat16", "bf16", "__nv_bfloat16", "torch.bfloat16")
_add("int64", 8, "long int", "long", "Long", "i64", "int64_t", "torch.int64")
_add("int32", 4, "int", "Int", "i32", "int32_t", "torch.int32")
_add("int16", 2, "short int", "short", "Short", "i16", "int16_t", "torch.int16")
_add("int8", 1, "signed char", "Char", "i8", "int8_t", "torch.int8")
_add("uint8", 1, "unsigned char", "Byte", "u8", "uint8_t", "torch.uint8")
_add("uint16", 2, "unsigned short", "UInt16", "u16", "uint16_t", "torch.uint16")
_add("uint32", 4, "unsigned int", "UInt32", "u32", "uint32_t", "torch.uint32")
_add("uint64", 8, "unsigned long", "UInt64", "u64", "uint64_t", "torch.uint64")
_add("bool", 1, "Bool", "torch.bool")
_add("complex64", 8, "c10::complex<float>", "ComplexFloat", "torch.complex64")
_add("complex128", 16, "c10::complex<double>", "ComplexDouble", "torch.complex128")
_add("float8_e4m3fn", 1, "c10::Float8_e4m3fn", "Float8_e4m3fn", "f8e4m3", "__nv_fp8_e4m3")
_add("float8_e5m2", 1, "c10::Float8_e5m2", "Float8_e5m2", "f8e5m2", "__nv_fp8_e5m2")


def dtype_info(spelling: str | None) -> tuple[str, int] | None:
    """(canonical dtype, bytes per element) for a dtype as any trace spells it, else None."""
    if not spelling:
        return None
    return _DTYPES.get(spelling.strip().strip('"'))


_KERNEL_DTYPE = re.compile(r"_(f32|f16|bf16|f64|i8|u8|i32|u32|i64|u64|f8e4m3|f8e5m2|float|half|"
                           r"__nv_bfloat16|double|int8_t|uint8_t|int32_t|uint32_t|int64_t|"
                           r"uint64_t)(?=_|\(|$)")


def kernel_dtype(name: str) -> str | None:
    """The dtype token in an NCCL kernel's name (`..._Sum_f32_RING_LL`), canonical, or None."""
    match = _KERNEL_DTYPE.search(name)
    info = dtype_info(match.group(1)) if match else None
    return info[0] if info else None
