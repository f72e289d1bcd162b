"""What NCCL can do in this process: whether it is usable at all (`unavailable_reason`, with
what to install: `INSTALL_HINT`), and the NCCL datatypes and ops a reduction of a dtype maps to
(`nccl_reduction`, `NCCL_OPS`; `NCCL_BYTES` for what moves raw bytes)."""

from __future__ import annotations

import importlib

from dataparallel.backends.base import ReduceOp

__all__ = [
    "INSTALL_HINT",
    "NCCL_BYTES",
    "NCCL_OPS",
    "NCCL_TYPES",
    "nccl_reduction",
    "unavailable_reason",
]

INSTALL_HINT = (
    "The 'nccl' backend needs an NVIDIA GPU with its driver, CuPy built for its CUDA "
    "(pip install cupy-cuda12x, or cupy-cuda11x) and the NCCL library where CuPy loads it "
    "(python -m cupyx.tools.install_library --library nccl --cuda 12.x, or a system libnccl2); "
    "torch tensors are reduced through CuPy too. Without a GPU, use backend='mpi' or 'gloo'."
)

# ncclDataType_t and ncclRedOp_t values (nccl.h), stable since NCCL 2.0 (bfloat16 since 2.10).
NCCL_TYPES = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
NCCL_BYTES = NCCL_TYPES["uint8"]
NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3}
_COMPLEX_PARTS = {"complex64": "float32", "complex128": "float64"}


def nccl_reduction(dtype: str, op: ReduceOp) -> tuple[int, int] | None:
    """Return (NCCL datatype, items per element) to reduce `dtype` with `op`, or None.

    None means NCCL cannot do it (int16, uint16, bool, complex products): the backend then takes a
    host round trip through its fallback engine.

    >>> nccl_reduction("bfloat16", ReduceOp.MAX), nccl_reduction("complex64", ReduceOp.SUM)
    ((9, 1), (7, 2))
    """
    if dtype in NCCL_TYPES:
        return NCCL_TYPES[dtype], 1
    if dtype in _COMPLEX_PARTS and op is ReduceOp.SUM:
        return NCCL_TYPES[_COMPLEX_PARTS[dtype]], 2
    return None


def unavailable_reason() -> str | None:
    """Return why NCCL cannot be used by this process (with what to install), or None if it can."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError:
        return f"CuPy is not installed. {INSTALL_HINT}"
    try:
        nccl = importlib.import_module("cupy.cuda.nccl")
    except ImportError as exc:
        return f"CuPy cannot load NCCL ({exc}). {INSTALL_HINT}"
    if not getattr(nccl, "available", False):
        return f"CuPy cannot load the NCCL library. {INSTALL_HINT}"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # any CUDA failure means: no usable GPU here
        return f"CUDA is not usable here ({type(exc).__name__}: {exc}). {INSTALL_HINT}"
    if count < 1:
        return f"No CUDA GPU is visible to this process. {INSTALL_HINT}"
    return None
