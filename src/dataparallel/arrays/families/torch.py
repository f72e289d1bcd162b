"""The torch family: CPU tensors seen through zero-copy NumPy views (torch is told of the writes:
version counters), CUDA tensors packed on their device, the rest staged; and which tensors
cannot be communicated at all (`TorchFamily.problem`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from dataparallel.arrays.dtypes import dtype_name
from dataparallel.arrays.families.base import Family, Work, device_work

if TYPE_CHECKING:
    import torch

__all__ = ["TorchFamily"]


class TorchFamily(Family["torch.Tensor"]):
    name = "torch"
    tracks_writes = True

    def dtype(self, x: torch.Tensor) -> str:
        return dtype_name(x.dtype)

    def shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape)

    def device(self, x: torch.Tensor) -> str:
        return str(x.device)

    def _host_numpy(self, t: torch.Tensor) -> np.ndarray:
        import torch

        t = t.detach()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def host_view(self, x: torch.Tensor) -> np.ndarray | None:
        if x.device.type != "cpu" or x.is_conj() or x.is_neg():
            return None
        return self._host_numpy(x)

    def work(self, x: torch.Tensor) -> tuple[Work, bool]:
        view = self.host_view(x)
        if view is not None:
            return view, True
        if x.is_cuda:
            return device_work(self, x), True
        return self.to_host(x), False

    def to_host(self, x: torch.Tensor) -> np.ndarray:
        return np.array(self._host_numpy(x.detach().cpu().resolve_conj().resolve_neg()))

    def _tensor(self, like: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(host))
        if like.dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t

    def from_host(self, x: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        import torch

        with torch.no_grad():
            x.copy_(self._tensor(x, host).reshape(x.shape))
        return x

    def new(self, like: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        return self._tensor(like, np.array(host)).to(like.device)

    def mark_written(self, xs: list[torch.Tensor]) -> None:
        """Bump the tensors' version counters, as torch's own in-place operations do.

        A tensor saved for backward and then written through a NumPy view would otherwise give
        a silently wrong gradient; with the bump, backward raises torch's usual "modified by an
        inplace operation" error. (Tensors made under `torch.inference_mode()` have no counter.)
        """
        import torch

        torch.autograd.graph.increment_version(xs)

    def adopt(self, like: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        return self._tensor(like, host).to(like.device)  # on the CPU: host's memory itself

    def host_views(self, xs: list[torch.Tensor]) -> list[np.ndarray] | None:
        """Each of `xs`'s `host_view`, or None where one has none: in one call, most of them
        made by `numpy()` alone, which refuses what `host_view` refuses (another device, a
        negative or conjugate bit, a layout not dense) and tensors that require grad (those
        are seen one by one, as is bfloat16, which NumPy lacks)."""
        import torch

        if xs and xs[0].dtype is not torch.bfloat16:
            try:
                return [x.numpy() for x in xs]
            except (RuntimeError, TypeError):
                pass
        views = [self.host_view(x) for x in xs]
        return None if any(view is None for view in views) else cast("list[np.ndarray]", views)

    def adopt_into(
        self, likes: list[torch.Tensor], places: list[tuple[int, int]], host: np.ndarray
    ) -> None:
        """Make each of host tensors `likes` use its place (start, stop) of 1-D `host` as its
        memory (`set_`), without a copy: the same tensor objects, so that whoever holds one
        sees its values, each a tensor of its own memory (`adopt`'s), not a view of a shared
        one."""
        import torch

        with torch.no_grad():
            for like, (start, stop) in zip(likes, places, strict=True):
                values = torch.from_numpy(host[start:stop])
                if like.dtype is torch.bfloat16:
                    values = values.view(torch.bfloat16)
                like.set_(values.view(like.shape))  # type: ignore[call-overload]

    def problem(self, t: torch.Tensor) -> str | None:
        """Return why tensor `t` cannot be communicated (nested, sparse, meta), or None."""
        if t.is_nested:
            return (
                "a nested torch tensor cannot be communicated, only dense (strided) ones: pass its "
                "components (t.unbind()) or a padded tensor (t.to_padded_tensor(0.0))."
            )
        if t.layout != _torch_strided():
            return (
                f"a torch tensor of layout {t.layout} cannot be communicated, only dense (strided) "
                "ones: pass t.to_dense(), or its indices and values as dense tensors."
            )
        if t.device.type == "meta":
            return (
                "a torch tensor on the 'meta' device has no data to communicate: give it storage "
                "first (e.g. module.to_empty(device='cpu'), then initialize it)."
            )
        return None


def _torch_strided() -> torch.layout:
    import torch

    return torch.strided
