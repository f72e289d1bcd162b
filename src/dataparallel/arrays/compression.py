"""Compression of reductions: floating values travel as 16-bit floats and come back in their dtype.

`Compression.fp16` and `Compression.bf16` have the shape of Horovod's compressors (a class with
`compress(tensor) -> (tensor, ctx)` and `decompress(tensor, ctx)`), and are accepted as
`compression=` by `dp.allreduce`, `dp.iallreduce`, `dp.allreduce_gradients`,
`dp.DistributedOptimizer` and `dp.torch.DataParallelModel`. Those calls do not call `compress`
leaf by leaf: `Fusion` reads the compressor's `wire` dtype and packs each bucket of
floating leaves (float16, bfloat16, float32, float64) into one 16-bit wire buffer
(`to_wire`), has the engine reduce that buffer in 16 bits, and widens the result back into the
leaves' dtype (`from_wire`), applying `avg`'s or `scale`'s factor in the wide dtype. Other dtypes
(integers, bool, complex) travel as they are.

What travels is 16 bits on every engine (`Backend.iallreduce_half`): Gloo and NCCL reduce
float16 and bfloat16 natively; MPI (no bfloat16, and a slow float16 sum in MPICH) sums with a
16-bit op of its own (`backends/mpi/backend.py`). The conversions use torch's vectorized casts
when torch is loaded, NumPy's (slower, benchmarks/NOTES.md "Compression's casts") otherwise.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import numpy as np

from dataparallel.arrays.dtypes import bf16_to_f32, f32_to_bf16
from dataparallel.arrays.families import array_family
from dataparallel.types import WireDtype

if TYPE_CHECKING:
    import torch

__all__ = [
    "COMPRESSIBLE",
    "WIRE_DTYPES",
    "BF16Compressor",
    "BF16FeedbackCompressor",
    "Compressing",
    "Compression",
    "Compressor",
    "FP16Compressor",
    "FP16FeedbackCompressor",
    "NoneCompressor",
    "PowerSGDCompressor",
    "from_wire",
    "to_wire",
    "wire_dtype",
]

# Dtypes a compressed reduction sends as its 16-bit wire dtype.
COMPRESSIBLE = frozenset({"float16", "bfloat16", "float32", "float64"})
# The wire dtypes, by name: a name checked against this is a `WireDtype`.
WIRE_DTYPES: dict[str, WireDtype] = {"float16": "float16", "bfloat16": "bfloat16"}


class Compressor:
    """Horovod's compressor interface, with the wire dtype `Fusion` reads.

    Attributes:
        wire: the dtype name floating values travel as (`"float16"`, `"bfloat16"`), or None.
        error_feedback: whether each rank keeps what rounding to `wire` took from each gradient
            and adds it to that gradient at the next step (`dp.torch`'s gradient reductions).
    """

    wire: ClassVar[WireDtype | None] = None
    error_feedback: ClassVar[bool] = False
    low_rank: ClassVar[bool] = False  # `PowerSGDCompressor`: gradients travel as thin matrices

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, object]:
        """Return `tensor` cast to the wire dtype (floating tensors only), and its dtype.

        Works on torch tensors, NumPy arrays (bfloat16 needs `ml_dtypes`), JAX arrays and CuPy
        arrays (float16 only).
        """
        dtype = tensor.dtype
        if cls.wire is None or not _is_floating(tensor):
            return tensor, dtype
        return _cast(tensor, cls.wire), dtype

    @classmethod
    def decompress(cls, tensor: Any, ctx: object) -> Any:
        """Return `tensor` cast back to `ctx`, the dtype `compress` returned."""
        if cls.wire is None or tensor.dtype == ctx:
            return tensor
        if array_family(tensor) == "torch":
            return tensor.to(ctx)
        return tensor.astype(ctx)


class NoneCompressor(Compressor):
    """No compression: values travel in their own dtype."""


class FP16Compressor(Compressor):
    """Floating values travel as float16 (IEEE half: 10-bit mantissa, range +-65504)."""

    wire = "float16"


class BF16Compressor(Compressor):
    """Floating values travel as bfloat16 (8-bit mantissa, float32's range)."""

    wire = "bfloat16"


class FP16FeedbackCompressor(FP16Compressor):
    """float16 on the wire, with error feedback: the rounding residual of each gradient is kept
    and added to it at the next step (torch `DistributedOptimizer` and `DataParallelModel`)."""

    error_feedback = True


class BF16FeedbackCompressor(BF16Compressor):
    """bfloat16 on the wire, with error feedback (as `FP16FeedbackCompressor`)."""

    error_feedback = True


class PowerSGDCompressor(Compressor):
    """Low-rank gradient compression (PowerSGD, Vogels et al. 2019): make one with
    `Compression.powersgd`.

    Each gradient viewed as a matrix `M` (its first dimension by the rest) travels as two thin
    matrices: `P = M Q` is averaged over ranks and orthonormalized, `Q = M^T P` is averaged, and
    the gradient becomes `P Q^T`, one step of power iteration towards `M`'s best rank-`rank`
    approximation. torch's `dp.DistributedOptimizer` and `dp.torch.DataParallelModel` take it
    (the state below lives on their gradient reduction, `dataparallel.torch`), and the optax
    `dp.DistributedOptimizer` (the state lives in its optax state, `dataparallel.jax`); what it
    keeps and when it pays: docs/compression.md. The names and defaults are those of torch's
    `PowerSGDState` where they mean the same.

    Attributes:
        rank: the approximation's rank (torch's `matrix_approximation_rank`, default 1).
        start_iter: steps reduced exactly before compression begins (torch's
            `start_powerSGD_iter`, default 1000): early gradients change fast.
        min_compression_rate: a matrix is compressed only where its element count is more than
            this many times the `(rows + columns) * rank` that would travel (default 2); the
            others, and 1-D tensors, travel uncompressed in the usual fused buckets.
        use_error_feedback: each rank keeps what the approximation dropped from its gradient and
            adds it at the next step (default True).
        warm_start: keep each matrix's `Q` from step to step (default True); else draw a new one
            at every step.
        random_seed: the seed of the first (or every, without warm start) `Q`, the same on every
            rank (default 0).
    """

    low_rank = True

    def __init__(
        self,
        rank: int = 1,
        *,
        start_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        random_seed: int = 0,
    ) -> None:
        for name, value, least in (("rank", rank, 1), ("start_iter", start_iter, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"dp.Compression.powersgd: {name}={value!r} must be an int of at least {least}."
                )
        if isinstance(random_seed, bool) or not isinstance(random_seed, int):
            raise ValueError(f"dp.Compression.powersgd: random_seed={random_seed!r} is not an int.")
        if not isinstance(min_compression_rate, (int, float)) or min_compression_rate < 0:
            raise ValueError(
                f"dp.Compression.powersgd: min_compression_rate={min_compression_rate!r} must be "
                "a number of at least 0 (1: compress every matrix that shrinks)."
            )
        self.rank, self.start_iter = rank, start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback, self.warm_start = bool(use_error_feedback), bool(warm_start)
        self.random_seed = random_seed

    def __repr__(self) -> str:
        return (
            f"dp.Compression.powersgd(rank={self.rank}, start_iter={self.start_iter}, "
            f"min_compression_rate={self.min_compression_rate}, "
            f"use_error_feedback={self.use_error_feedback}, warm_start={self.warm_start}, "
            f"random_seed={self.random_seed})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PowerSGDCompressor) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, object]:
        """Refuse: a low-rank approximation needs every rank's matrix (see the class)."""
        raise TypeError(
            "dp.Compression.powersgd compresses gradients across ranks (power iteration needs "
            "two reductions per step), not one tensor: pass it as compression= to "
            "dp.DistributedOptimizer (torch or optax) or dp.torch.DataParallelModel."
        )


class Compression:
    """The compressors, by Horovod's names: `none`, `fp16`, and `bf16`; and `fp16_feedback`,
    `bf16_feedback`: the same with error feedback, for gradient reductions that keep state;
    `powersgd(rank=...)`: low-rank compression of the gradient reductions of torch's and
    optax's `DistributedOptimizer` and of `dp.torch.DataParallelModel`.

    >>> import numpy as np, dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> dp.allreduce(np.array([1.0, 2.0]), op="avg", compression=dp.Compression.fp16)
    array([1., 2.])
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    fp16_feedback = FP16FeedbackCompressor
    bf16_feedback = BF16FeedbackCompressor
    powersgd = PowerSGDCompressor


# What `compression=` takes: `dp.Compression.fp16` and friends (classes or instances), or None.
Compressing: TypeAlias = type[Compressor] | Compressor | None


def wire_dtype(compression: object, *, stateful: bool = False) -> WireDtype | None:
    """Return the wire dtype of `compression` (a `Compressor` class or instance, or None).

    `stateful`: whether the caller keeps per-parameter state across steps, which error feedback
    needs (torch's gradient reductions); other callers refuse a compressor with feedback.

    Raises:
        TypeError: `compression` is not one of dataparallel's compressors, or has error
            feedback where no state is kept.
    """
    if compression is None:
        return None
    kind = compression if isinstance(compression, type) else type(compression)
    if isinstance(kind, type) and issubclass(kind, Compressor) and kind.low_rank:
        if not stateful:
            raise TypeError(
                "compression=dp.Compression.powersgd(...) keeps a low-rank basis and residuals "
                "per parameter from step to step, which only torch's dp.DistributedOptimizer and "
                "dp.torch.DataParallelModel and the optax dp.DistributedOptimizer (without "
                "shard_state) can (they hold the parameters or the state); here use "
                "dp.Compression.fp16 or dp.Compression.bf16."
            )
        if isinstance(compression, type):
            raise TypeError(
                "compression=dp.Compression.powersgd must be called: "
                "compression=dp.Compression.powersgd(rank=1, start_iter=...)."
            )
        return None
    if issubclass(kind, Compressor):
        if kind.error_feedback and not stateful:
            raise TypeError(
                f"compression={kind.__name__} keeps each gradient's rounding residual from "
                "step to step, which only torch's dp.DistributedOptimizer and "
                "dp.torch.DataParallelModel can (they hold the parameters); here use "
                f"dp.Compression.{'fp16' if kind.wire == 'float16' else 'bf16'} (no feedback)."
            )
        return kind.wire
    raise TypeError(
        f"compression={compression!r} is not a compressor: use dp.Compression.none, "
        "dp.Compression.fp16 or dp.Compression.bf16 (the engine compresses whole buckets on the "
        "wire, so custom compressors with only compress/decompress are not taken)."
    )


def to_wire(values: np.ndarray, dtype: str, wire: WireDtype, out: np.ndarray) -> None:
    """Write host `values` (storage of `dtype`) into `out` (storage of `wire`), rounding.

    Rounds to nearest even; beyond float16's range values become inf, as a cast does.
    """
    torch = sys.modules.get("torch")
    if torch is not None:  # one vectorized cast (NumPy's float16 casts are scalar loops)
        _as_torch(torch, out, wire).copy_(_as_torch(torch, values, dtype))
        return
    with np.errstate(over="ignore"):
        if dtype == wire or (wire == "float16" and dtype != "bfloat16"):
            out[...] = values
            return
        wide = bf16_to_f32(values) if dtype == "bfloat16" else values.astype(np.float32)
        if wire == "float16":
            out[...] = wide
        else:
            f32_to_bf16(wide, out=out)


def from_wire(
    values: np.ndarray, wire: WireDtype, out: np.ndarray, dtype: str, scale: float | None
) -> None:
    """Write reduced wire `values` into `out` (storage of `dtype`), times `scale` when given.

    The scale is applied in float32 (float64 for float64 leaves), before rounding to `dtype`;
    `values` and `out` may be the same array.
    """
    scaled = scale is not None and scale != 1
    torch = sys.modules.get("torch")
    if dtype in ("float32", "float64"):
        if torch is not None:
            _as_torch(torch, out, dtype).copy_(_as_torch(torch, values, wire))
        else:
            out[...] = bf16_to_f32(values) if wire == "bfloat16" else values
        if scaled:
            out *= scale
        return
    if torch is not None:
        wide = _as_torch(torch, values, wire).float()
        if scaled and scale is not None:
            wide.mul_(scale)
        _as_torch(torch, out, dtype).copy_(wide)
        return
    wide_np = bf16_to_f32(values) if wire == "bfloat16" else values.astype(np.float32)
    if scaled:
        wide_np *= np.float32(scale)
    if dtype == "bfloat16":
        f32_to_bf16(wide_np, out=out)
    else:
        with np.errstate(over="ignore"):
            out[...] = wide_np


def _as_torch(torch: ModuleType, values: np.ndarray, dtype: str) -> torch.Tensor:
    """Return a torch view of host `values` (storage of `dtype`: bfloat16 as its bits)."""
    if dtype == "bfloat16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def _is_floating(tensor: Any) -> bool:
    if array_family(tensor) == "torch":
        return bool(tensor.dtype.is_floating_point)
    kind = getattr(tensor.dtype, "kind", None)
    return kind == "f" or str(tensor.dtype) == "bfloat16"


def _cast(tensor: Any, wire: WireDtype) -> Any:
    family = array_family(tensor)
    if family == "torch":
        import torch

        return tensor.to(getattr(torch, wire))
    if family == "jax":
        import jax.numpy as jnp

        return tensor.astype(getattr(jnp, wire))
    if wire == "float16":
        return tensor.astype(np.float16)
    if family == "numpy" or family is None:
        if "ml_dtypes" not in sys.modules:
            try:
                import ml_dtypes  # noqa: F401
            except ImportError:
                raise TypeError(
                    "NumPy has no bfloat16: Compression.bf16.compress on a NumPy array needs "
                    "ml_dtypes (pip install ml_dtypes). Collectives compress NumPy arrays "
                    "without it."
                ) from None
        return np.asarray(tensor).astype(sys.modules["ml_dtypes"].bfloat16)
    raise TypeError(
        f"{family} arrays have no bfloat16 dtype: use Compression.fp16 with compress(), or pass "
        "compression= to the collectives, which compress on the wire."
    )
