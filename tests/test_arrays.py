"""Array families (`dataparallel.arrays.families`): recognizing leaves, seeing, staging memory."""

from __future__ import annotations

import warnings
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from dataparallel.arrays.dtypes import (
    SUPPORTED_DTYPES,
    bf16_to_f32,
    f32_to_bf16,
    prescale,
    scale_in_place,
    storage_dtype,
)
from dataparallel.arrays.families import family_of
from dataparallel.arrays.pool import BufferPool

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


@pytest.mark.parametrize(
    ("leaf", "family", "dtype"),
    [
        (np.zeros(2, np.float32), "numpy", "float32"),
        (np.zeros(2, ml_dtypes.bfloat16), "numpy", "bfloat16"),
        (np.zeros(2, ">f8"), "numpy", "float64"),
        (np.bool_(True), "scalar", "bool"),
        (np.uint16(3), "scalar", "uint16"),
        (ml_dtypes.bfloat16(1.5), "scalar", "bfloat16"),
        (True, "scalar", "bool"),
        (3, "scalar", "int64"),
        (2.5, "scalar", "float64"),
        (1j, "scalar", "complex128"),
        (torch.zeros(2, dtype=torch.bfloat16), "torch", "bfloat16"),
        (torch.nn.Parameter(torch.zeros(2)), "torch", "float32"),
        (torch.zeros(2, dtype=torch.uint32), "torch", "uint32"),
        (jnp.zeros(2, jnp.bfloat16), "jax", "bfloat16"),
        (jnp.zeros(2, jnp.int8), "jax", "int8"),
    ],
    ids=repr,
)
def test_family_and_dtype_of_leaves(leaf: Any, family: str, dtype: str) -> None:
    found = family_of(leaf)
    assert found.name == family and found.dtype(leaf) == dtype
    # JAX puts new arrays on its default device: a GPU where JAX has one ("gpu:0").
    on = "cpu" if family != "jax" else next(iter(leaf.devices())).platform
    assert found.device(leaf) == ("cpu" if on == "cpu" else f"{on}:0")
    assert found.shape(leaf) == (() if family == "scalar" else (2,))


def _complex32() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "ComplexHalf support is experimental"
        return torch.zeros(1, dtype=torch.complex32)


@pytest.mark.parametrize(
    ("leaf", "message"),
    [
        (np.array(["a"]), r"^w\[0\]: dtype str"),
        (np.array([None]), r"^w\[0\]: dtype object is not supported by collectives; use one of"),
        (np.zeros(1, np.longdouble), r"^w\[0\]: dtype float\d+ is not supported"),
        (np.zeros(1, "datetime64[s]"), r"^w\[0\]: dtype datetime64"),
        (_complex32, r"^w\[0\]: dtype complex32 is not supported"),
        ("text", r"^w\[0\]: expected an array \(NumPy, PyTorch, JAX, CuPy\) or a number, got "),
        (b"bytes", r"got builtins\.bytes"),
        (object(), r"got builtins\.object"),
        (2**63, r"^w\[0\]: the integer 9223372036854775808 does not fit in int64"),
        (-(2**63) - 1, r"does not fit in int64"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) or v.startswith("^") else v,
)
def test_unsupported_leaves_name_their_path(leaf: Any, message: str) -> None:
    if leaf is _complex32:
        leaf = _complex32()
    with pytest.raises(TypeError, match=message):
        family_of(leaf, "w[0]")


def test_unsupported_dtype_message_lists_the_supported_ones() -> None:
    with pytest.raises(TypeError) as info:
        family_of(np.array(["a"]))
    for dtype in SUPPORTED_DTYPES:
        assert dtype in str(info.value)


def test_int64_bounds_are_accepted() -> None:
    assert family_of(2**63 - 1).dtype(2**63 - 1) == "int64"
    assert family_of(-(2**63)).name == "scalar"


def test_traced_jax_values_are_refused() -> None:
    seen = []

    @jax.jit
    def f(x: Any) -> Any:
        with pytest.raises(TypeError, match=r"^x: got a traced JAX value, .* outside jax\.jit"):
            family_of(x)
        seen.append(1)
        return x

    f(jnp.ones(2))
    assert seen == [1]


def test_storage_dtype() -> None:
    assert storage_dtype("bfloat16") == np.uint16
    for dtype in SUPPORTED_DTYPES - {"bfloat16"}:
        assert storage_dtype(dtype) == np.dtype(dtype)


def test_bfloat16_conversions_match_ml_dtypes() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(1000).astype(np.float32) * 1e3,
            np.array([0.0, -0.0, 1.0, np.inf, -np.inf, 3.4e38, 1e-40, -1e-40], np.float32),
            # Exactly halfway between two bfloat16 values: round to the even one.
            np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], np.float32),
        ]
    )
    bits = f32_to_bf16(values, np.empty(values.size, np.uint16))
    np.testing.assert_array_equal(bits, values.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert list(bits[-3:]) == [0x3F80, 0x3F82, 0xBF80]
    wide = bf16_to_f32(bits)
    np.testing.assert_array_equal(wide, values.astype(ml_dtypes.bfloat16).astype(np.float32))
    out = np.empty(bits.size, np.float32)
    assert bf16_to_f32(bits, out=out) is out
    np.testing.assert_array_equal(out, wide)


def test_nan_stays_nan_through_bfloat16() -> None:
    nans = np.array([np.nan, -np.nan], np.float32)
    bits = f32_to_bf16(nans, np.empty(2, np.uint16))
    assert np.isnan(bf16_to_f32(bits)).all()


def test_numpy_host_view_is_zero_copy_and_writes_land() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    family = family_of(x)
    work, is_view = family.work(x)
    assert is_view and np.shares_memory(work, x)
    work[0, 0] = 42
    assert x[0, 0] == 42
    strided = x[:, ::2]
    view, is_view = family.work(strided)
    assert is_view and view.shape == (2, 2) and np.shares_memory(view, x)


def test_numpy_bfloat16_is_seen_as_bits() -> None:
    x = np.array([1.0, 2.0], ml_dtypes.bfloat16)
    work, is_view = family_of(x).work(x)
    assert is_view and work.dtype == np.uint16
    assert list(work) == [0x3F80, 0x4000]


def test_read_only_and_byte_swapped_arrays_are_staged() -> None:
    frozen = np.ones(3)
    frozen.flags.writeable = False
    family = family_of(frozen)
    work, is_view = family.work(frozen)
    assert not is_view and not np.shares_memory(work, frozen)
    work[...] = 7
    out = family.from_host(frozen, work)
    assert out is not frozen and list(out) == [7, 7, 7] and list(frozen) == [1, 1, 1]
    swapped = np.arange(3, dtype=">i4")
    work, is_view = family.work(swapped)
    assert not is_view and work.dtype == np.dtype("=i4") and list(work) == [0, 1, 2]
    work += 300
    assert family.from_host(swapped, work) is swapped
    assert list(swapped) == [300, 301, 302] and swapped.dtype == np.dtype(">i4")


def test_torch_host_view_is_zero_copy() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(3, 2).T
    family = family_of(t)
    work, is_view = family.work(t)
    assert is_view and work.shape == (2, 3)
    work[1, 2] = -1
    assert t[1, 2] == -1
    bf = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    bits, is_view = family.work(bf)
    assert is_view and bits.dtype == np.uint16 and list(bits) == [0x3F80, 0x4000]
    param = torch.nn.Parameter(torch.ones(2))
    view, is_view = family.work(param)
    assert is_view
    view[0] = 5
    assert param[0].item() == 5 and param.requires_grad


def test_torch_lazy_conjugate_and_negative_views_are_staged() -> None:
    z = torch.tensor([1 + 2j], dtype=torch.complex64).conj()
    family = family_of(z)
    work, is_view = family.work(z)
    assert not is_view and work[0] == 1 - 2j
    work[0] = 3 + 4j
    assert family.from_host(z, work) is z and z[0].item() == 3 + 4j


def test_jax_arrays_are_staged_and_come_back_new() -> None:
    x = jnp.arange(4, dtype=jnp.float32).reshape(2, 2)
    family = family_of(x)
    work, is_view = family.work(x)
    assert not is_view and work.flags.writeable
    work += 1
    out = family.from_host(x, work)
    assert out is not x and out.dtype == x.dtype and out.shape == (2, 2)
    np.testing.assert_array_equal(np.asarray(out), np.arange(4).reshape(2, 2) + 1)
    np.testing.assert_array_equal(np.asarray(x), np.arange(4).reshape(2, 2))
    bf = jnp.ones(2, jnp.bfloat16)
    bits = family_of(bf).to_host(bf)
    assert bits.dtype == np.uint16 and list(bits) == [0x3F80, 0x3F80]


@pytest.mark.parametrize(
    "value", [True, 7, 2.5, 1 - 1j, np.int8(-3), np.float16(0.5), ml_dtypes.bfloat16(1.5)]
)
def test_scalars_round_trip_with_their_type(value: Any) -> None:
    family = family_of(value)
    work, is_view = family.work(value)
    assert not is_view and work.shape == ()
    out = family.from_host(value, work)
    assert type(out) is type(value) and out == value
    gathered = family.new(value, np.stack([work, work]))
    assert gathered.shape == (2,) and list(gathered) == [value, value]


def test_new_makes_arrays_of_the_family() -> None:
    host = np.arange(6, dtype=np.float32).reshape(3, 2)
    t = family_of(torch.zeros(1)).new(torch.zeros(1), host)
    assert isinstance(t, torch.Tensor) and t.shape == (3, 2) and t.dtype == torch.float32
    j = family_of(jnp.zeros(1)).new(jnp.zeros(1), host)
    assert isinstance(j, jax.Array) and j.shape == (3, 2)
    bits = np.array([0x3F80, 0x4000], np.uint16)
    tb = family_of(torch.zeros(1, dtype=torch.bfloat16)).new(
        torch.zeros(1, dtype=torch.bfloat16), bits
    )
    assert tb.dtype == torch.bfloat16 and tb.tolist() == [1.0, 2.0]


def test_buffer_pool_reuses_buffers_by_dtype_and_size_class() -> None:
    pool = BufferPool()
    a = pool.take(np.dtype(np.float32), 10)
    assert a.shape == (10,) and a.dtype == np.float32
    pool.give(a)
    b = pool.take(np.dtype(np.float32), 1000)  # same size class (1024)
    assert np.shares_memory(a, b)
    c = pool.take(np.dtype(np.float32), 10)  # b is out: a new buffer
    assert not np.shares_memory(b, c)
    d = pool.take(np.dtype(np.float64), 10)  # another dtype never shares
    assert not np.shares_memory(d, b) and d.dtype == np.float64
    big = pool.take(np.dtype(np.uint8), 5000)
    assert big.base is not None and big.base.size == 8192
    pool.give(big)
    assert np.shares_memory(pool.take(np.dtype(np.uint8), 4097), big)
    assert pool.take(np.dtype(np.uint8), 0).size == 0
    assert pool.allocated == 4096 + 4096 + 8192 + 8192  # the buffers it made, out or free


def test_an_exact_pool_keeps_no_more_than_is_in_use_and_counts_it() -> None:
    pool = BufferPool(exact=True)
    f32 = np.dtype(np.float32)
    a = pool.take(f32, 10)
    assert a.shape == (10,) and pool.allocated == 40  # no size class: what was asked for
    pool.give(a)
    b = pool.take(f32, 6)  # a free buffer that holds the request serves it
    assert np.shares_memory(a, b) and b.shape == (6,) and pool.allocated == 40
    pool.give(b)
    c = pool.take(f32, 30)  # the free one is too small: dropped, a new one made
    assert not np.shares_memory(a, c) and pool.allocated == 160  # a's still held here
    del a, b
    assert pool.allocated == 120  # the dropped buffer is no longer counted once it is gone
    d = pool.take(f32, 30)  # c is out: another buffer
    assert pool.allocated == 240
    pool.give(c)
    pool.give(d)
    assert pool.allocated == 240 and np.shares_memory(pool.take(f32, 1), c)  # first fit


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
def test_an_average_is_the_sum_divided_by_n_bit_for_bit(dtype: Any, n: int) -> None:
    # Powers of two multiply by 1/n (cheaper), the others divide: both give x / n exactly,
    # subnormals and the extremes included.
    info = np.finfo(dtype)
    values = np.concatenate(
        [
            np.random.default_rng(n).standard_normal(1000) * 1e3,
            [info.tiny, info.tiny / 8, info.max, -info.max, info.smallest_subnormal, 0.0, 3.0],
        ]
    ).astype(dtype)
    want = (values.astype(np.float32) / n).astype(dtype) if dtype == np.float16 else values / n
    got = values.copy()
    scale_in_place(got, 1 / n)
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_shares_scaled_before_the_sum_add_up_to_the_sum_scaled_bit_for_bit(
    dtype: Any, n: int
) -> None:
    """`prescale`: n ranks' shares scaled by 1/n (a power of two) and summed give the sum, summed
    in the same order, scaled, for every value down to the smallest normal number; a sum that
    overflows stays finite."""
    rng = np.random.default_rng(n)
    info = np.finfo(dtype)
    shares = []
    for _ in range(n):
        share = rng.standard_normal(2000) * 10.0 ** rng.integers(-30, 30, 2000)
        share[:4] = [info.max, -info.max, 4 * info.tiny, 0.0]
        shares.append(share.astype(dtype))
    scaled = [share.copy() for share in shares]
    assert all(prescale(share, 1 / n) for share in scaled)
    want, got = shares[0].copy(), scaled[0].copy()
    with np.errstate(over="ignore"):
        for share, share_scaled in zip(shares[1:], scaled[1:], strict=True):
            want += share
            got += share_scaled
    scale_in_place(want, 1 / n)
    bits = f"u{got.itemsize}"
    np.testing.assert_array_equal(got[2:].view(bits), want[2:].view(bits))
    assert np.isinf(want[:2]).all()  # the sum overflowed; scaled first, it does not
    np.testing.assert_array_equal(got[:2], [info.max, -info.max])


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [
        (np.float32, 1 / 3),
        (np.float32, 1.0),
        (np.float32, 2.0),
        (np.float64, None),
        (np.float16, 0.5),
        (np.int32, 0.5),
    ],
)
def test_prescale_leaves_what_it_cannot_scale_exactly(dtype: Any, scale: Any) -> None:
    values = np.arange(10).astype(dtype)
    assert not prescale(values, scale)
    np.testing.assert_array_equal(values, np.arange(10).astype(dtype))
