"""`fully_shard` (ZeRO stage 3): parameters sharded across ranks, gathered per module.

Applied to each block of a model and then to the model (as torch's FSDP2), every call makes a
`ShardGroup` of the parameters its module holds that no inner call took. Each parameter is cut
along its first dimension into `size` chunks as `torch.chunk` would; rank r keeps chunk r. A
group's chunks of one dtype lie end to end in one flat buffer (a *segment*, padded to the same
length on every rank), so one allgather per dtype brings the group back and one reduce-scatter
per dtype scatters its gradients. Between uses the parameters are the shards themselves
(`nn.Parameter`s viewing the segment), so any optimizer made on `model.parameters()` afterwards
steps this rank's rows only, and `parameter_shards()` says where each sits in the whole (what a
sharded checkpoint writes).

A step: a forward pre-hook gathers the group, waiting for the gather the module before it
prefetched, and prefetches the module that ran after it in the last forward; the forward hook
frees the parameters (storage resized to 0, as FSDP: autograd's saved tensors stay the same
objects) and hooks the outputs so that backward gathers again and prefetches. Each whole
parameter's post-accumulate hook counts it; a group whose trainable parameters all have their
gradient is reduce-scattered (averaged) into this rank's `.grad`s, in one order on every rank
(the last forward's, reversed). The end of backward reduces what is left; a flag per parameter
in every reduce-scatter keeps `grad=None` for one no rank used. The root keeps its parameters
until backward ends, as FSDP2's; `no_sync()` keeps whole gradients until a pass outside it.

Every rank must run the same modules in the same order (FSDP's rule), and calls start in one
order on every rank; where the engine cannot move a call on by itself (MPI), the call in flight
lands before the next starts. Device parameters are staged as ZeRO 1/2's. Usage: docs/zero.md.
"""

from __future__ import annotations

import contextlib
import enum
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch import nn

from dataparallel import world
from dataparallel.backends.base import Backend, Handle, ReduceOp
from dataparallel.groups import Group, backend_of
from dataparallel.torch._hooks import owner as owner_of
from dataparallel.torch._hooks import remove_hooks
from dataparallel.torch._zero import carry
from dataparallel.torch._zero.gradients import reduced_dtype
from dataparallel.torch._zero.layout import host_buffer
from dataparallel.torch._zero.optimizer import clip_slices

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["FullyShardedModule", "ParameterShard", "ShardGroup", "fully_shard"]

M = TypeVar("M", bound=nn.Module)
Out = TypeVar("Out")  # a module's output, handed on as it came

# Reduce-scatters in flight at once, on engines that move calls on by themselves: each holds a
# module's gradients (its send buffer, and on Gloo the rows it receives) until it lands, and one
# module's backward outlasts one module's reduce-scatter, so the one in flight lands when the
# next starts.
MAX_REDUCTIONS = 1


@dataclass(frozen=True)
class ParameterShard:
    """This rank's rows of one parameter, and where they sit in the whole parameter.

    `param` is the sharded parameter itself (what `model.parameters()` yields between uses and
    the optimizer steps): reading it reads the model, writing it in place writes the model, and
    the optimizer's state for it (`exp_avg`, ...) has its shape and the same offsets. A
    parameter of no dimension is held whole by rank 0 (shape `()`, offsets `()`); on the other
    ranks, and on ranks past the last rows, `param` is empty.
    """

    param: nn.Parameter
    shape: torch.Size  # the whole parameter's
    offsets: tuple[int, ...]  # where `param` begins in the whole parameter: (row, 0, ...)


class _Phase(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class _Param:
    """One parameter of a group: its shard, its whole form, and where it lies."""

    def __init__(self, name: str, param: nn.Parameter, rank: int, size: int) -> None:
        self.name = name
        self.shape = param.shape
        self.dtype = param.dtype
        self.trainable = param.requires_grad
        self.rows = param.shape[0] if param.dim() else 1
        self.row_items = math.prod(param.shape[1:]) if param.dim() else 1
        self.numel = param.numel()
        self.offset = 0  # in its segment (set by `_Segment`)
        self.segment = 0
        # Where the module holds it: (module, attribute) pairs (several when tied).
        self.places: list[tuple[nn.Module, str]] = []
        self.lay(rank, size, param.device)
        self.sharded: nn.Parameter  # set by the group, a view of its segment

    def lay(self, rank: int, size: int, device: torch.device) -> None:
        """Cut the parameter for `rank` of `size`, and make its whole form's buffer on
        `device` (storage freed)."""
        self.chunk = -(-self.rows // size)  # rows per rank (the last ranks' fewer or none)
        self.items = self.chunk * self.row_items  # this parameter's part of every segment
        self.mine = min(self.chunk, max(0, self.rows - rank * self.chunk))
        self.first = rank * self.chunk if self.mine else 0  # the first row this rank holds
        # The whole parameter, a view of `padded` (size * chunk rows); its storage is freed
        # between uses. Writes go through `padded.data`, whose version counter is not the
        # parameter's: the tensors the autograd graph saved stay valid when refilled.
        self.padded = torch.empty(size * self.items, dtype=self.dtype, device=device)
        self.whole = nn.Parameter(self.padded[: self.numel].view(self.shape), self.trainable)
        self.whole.untyped_storage().resize_(0)  # at once: one parameter's worth at a time

    def shard_shape(self) -> tuple[int, ...]:
        if not self.shape:
            return () if self.mine else (0,)
        return (self.mine, *self.shape[1:])

    @property
    def offsets(self) -> tuple[int, ...]:
        if not self.shape:
            return () if self.mine else (0,)
        return (self.first,) + (0,) * (len(self.shape) - 1)


class _Segment:
    """A group's parameters of one dtype: this rank's chunks end to end (`data`)."""

    def __init__(self, params: list[_Param], device: torch.device, backend: Backend) -> None:
        self.params = params
        self.dtype = params[0].dtype
        self.items = 0
        for p in params:
            p.offset = self.items
            self.items += p.items
        self.data = torch.zeros(self.items, dtype=self.dtype, device=device)
        self.wire = reduced_dtype(self.dtype, backend)  # what its gradients travel in

    @property
    def nbytes(self) -> int:
        return self.items * self.data.element_size()


class _Gather:
    """A group's allgather in flight: per segment, its handle and where every rank's lands."""

    def __init__(self, handles: list[Handle], rows: list[torch.Tensor]) -> None:
        self.handles, self.rows = handles, rows


class ShardGroup:
    """The parameters one `fully_shard` call took: sharded, gathered, freed, reduced.

    Args:
        module: the module `fully_shard` was applied to.
        params: its parameters that no inner `fully_shard` took, named, each once (tied ones
            are one parameter held in several places).
        places: for each of them, where the modules hold it.
        backend: the engine.
        reshard_after_forward: free the gathered parameters after the forward (else keep
            them until backward has used them).
        staged: the parameters are on a device (or forced, for tests): every engine call goes
            through host buffers.
    """

    def __init__(
        self,
        module: nn.Module,
        params: list[tuple[str, nn.Parameter]],
        places: dict[int, list[tuple[nn.Module, str]]],
        backend: Backend,
        *,
        reshard_after_forward: bool,
        staged: bool,
    ) -> None:
        self.module = module
        self.backend = backend
        self.reshard_after_forward = reshard_after_forward
        self.staged = staged
        self.sync_gradients = True
        rank, size = backend.rank, backend.size
        devices = {p.device for _, p in params}
        if len(devices) > 1:
            name = next(n for n, p in params if p.device != params[0][1].device)
            raise ValueError(
                f"fully_shard({type(module).__name__}): its parameters are on several devices "
                f"({', '.join(sorted(map(str, devices)))}; {name!r} is not on the first's). "
                "Move the module to one device before sharding it."
            )
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        self.params = [_Param(name, p, rank, size) for name, p in params]
        by_dtype: dict[torch.dtype, list[_Param]] = {}
        for info in self.params:
            by_dtype.setdefault(info.dtype, []).append(info)
        self.segments = [_Segment(ps, self.device, backend) for ps in by_dtype.values()]
        with torch.no_grad():
            for s, segment in enumerate(self.segments):
                for info in segment.params:
                    info.segment = s
            for info, (_, original) in zip(self.params, params, strict=True):
                segment = self.segments[info.segment]
                flat = original.detach().reshape(-1)
                lo, n = info.first * info.row_items, info.mine * info.row_items
                at = info.offset
                segment.data[at : at + n].copy_(flat[lo : lo + n])
                view = segment.data[at : at + n].view(info.shard_shape())
                info.sharded = nn.Parameter(view, requires_grad=original.requires_grad)
                info.places = places[id(original)]
        self.phase = _Phase.SHARDED
        self._gather: _Gather | None = None
        self._has_frozen = any(not info.trainable for info in self.params)
        self.context: _Context | None = None
        self.on_world = False  # over the whole world, not a group (set by fully_shard)
        self._handles: list[RemovableHandle] = []
        self._cleanup = weakref.finalize(self, remove_hooks, self._handles)
        ref = weakref.ref(self)
        for k, info in enumerate(self.params):
            if info.trainable:
                self._handles.append(
                    info.whole.register_post_accumulate_grad_hook(_on_grad(ref, k))
                )
        self._begin_backward()
        self._put(sharded=True)

    def materialize(self, device: torch.device) -> None:
        """Give a group made on the meta device memory on `device`: this rank's segments (and
        so its shards, views of them: their values unset, for the caller to initialize) and
        the whole parameters' buffers, empty until gathered. Nothing of another rank's rows
        is ever allocated. The shards are new `nn.Parameter`s: make the optimizer after."""
        if self.phase is not _Phase.SHARDED:
            raise RuntimeError(
                f"fully_shard({type(self.module).__name__}).to_empty: its parameters are "
                "gathered now; call it between steps."
            )
        self._lay_out(self.backend, torch.device(device), same_params=False)

    def relayout(self, backend: Backend) -> None:
        """Cut the parameters again for `backend`'s rank and size (a re-formed elastic world):
        new segments (zeros, for the caller to fill), whole-parameter buffers and hooks. The
        shards stay the same `nn.Parameter` objects, holding other rows now, so an optimizer
        made on them keeps them (its state of the old rows is the caller's to cut again). A
        gather or a backward the old world left unfinished is dropped, and the order of the
        modules is learnt again at the next forward. Not collective."""
        self._gather = None
        self.phase = _Phase.SHARDED
        self.context = None
        self._lay_out(backend, self.device, same_params=True)

    def _lay_out(self, backend: Backend, device: torch.device, *, same_params: bool) -> None:
        """Make the segments, the shards' views of them and the whole parameters for `backend`
        on `device` (new shard parameters unless `same_params`)."""
        remove_hooks(self._handles)
        self._handles.clear()
        self.backend = backend
        ref = weakref.ref(self)
        for info in self.params:
            info.lay(backend.rank, backend.size, device)
        self.segments = [_Segment(s.params, device, backend) for s in self.segments]
        with torch.no_grad():
            for k, info in enumerate(self.params):
                segment = self.segments[info.segment]
                n = info.mine * info.row_items
                view = segment.data[info.offset : info.offset + n].view(info.shard_shape())
                if same_params:
                    info.sharded.grad = None
                    info.sharded.data = view
                else:
                    info.sharded = nn.Parameter(view, requires_grad=info.sharded.requires_grad)
                    info.sharded._dp_shard = ref  # type: ignore[attr-defined]
                if info.trainable:
                    self._handles.append(
                        info.whole.register_post_accumulate_grad_hook(_on_grad(ref, k))
                    )
        self.device = device
        self.staged = self.staged or self.device.type != "cpu"
        self._begin_backward()
        self._put(sharded=True)

    # -- where the module's parameters are ---------------------------------------------------

    def _put(self, *, sharded: bool) -> None:
        """Make the modules hold the shards (between uses) or the whole parameters."""
        for info in self.params:
            param = info.sharded if sharded else info.whole
            for module, attr in info.places:
                module._parameters[attr] = param

    @property
    def sharded_bytes(self) -> int:
        """Bytes of this rank's segments."""
        return sum(s.nbytes for s in self.segments)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of whole parameters (and whole gradients) this rank holds now."""
        held = sum(info.whole.untyped_storage().nbytes() for info in self.params)
        grads = sum(info.whole.grad.nbytes for info in self.params if info.whole.grad is not None)
        return held + grads

    # -- gathering and freeing ----------------------------------------------------------------

    def start_gather(self) -> None:
        """Start the allgather of every segment (no-op unless sharded)."""
        if self.phase is not _Phase.SHARDED:
            return
        handles, rows = [], []
        context = self.context
        if context is not None:
            context.before_call()
        for segment in self.segments:  # all checked before any call starts
            if segment.data.is_meta:
                raise RuntimeError(
                    f"fully_shard({type(self.module).__name__}): its parameters are on the meta "
                    "device, which holds no values: call model.to_empty(device='cpu') (or a "
                    "GPU) on the sharded model first, then initialize this rank's shards."
                )
            self._check_views(segment)
        for segment in self.segments:
            nbytes = segment.nbytes
            raw = segment.data.view(torch.uint8)
            if self.staged:
                send = host_buffer(nbytes, torch.uint8, True)
                send.copy_(raw)  # blocking: waits for the step that wrote the shard
            else:
                send = raw
            recv = host_buffer(nbytes * self.backend.size, torch.uint8, self.staged)
            if self.backend.size == 1:
                recv.copy_(send)
            else:
                handles.append(self.backend.iallgather(send.numpy(), recv.numpy()))
            rows.append(recv)
        self._gather = _Gather(handles, rows)
        self.phase = _Phase.GATHERING
        if context is not None:
            context.in_flight(self._finish_handles)

    def _check_views(self, segment: _Segment) -> None:
        """Raise unless every shard is still a view of its segment (what is sent)."""
        at = segment.data.untyped_storage().data_ptr()
        for info in segment.params:
            shard = info.sharded
            if shard.numel() and shard.untyped_storage().data_ptr() != at:
                raise RuntimeError(
                    f"fully_shard({type(self.module).__name__}): the shard of {info.name!r} is "
                    "no longer the tensor fully_shard made (model.to(), .half(), .double() or "
                    "an assignment to param.data after fully_shard), so what it holds would "
                    "never be sent. Move or convert the model before fully_shard."
                )

    def _finish_handles(self) -> None:
        """Wait for this group's allgather (the engine's side only)."""
        if self._gather is not None:
            handles, self._gather.handles = self._gather.handles, []
            for handle in handles:
                handle.wait()

    def unshard(self) -> None:
        """Gather the whole parameters and put them in the module's place."""
        if self.phase is _Phase.UNSHARDED:
            return
        if self.phase is _Phase.SHARDED:
            self.start_gather()
        gather = self._gather
        assert gather is not None
        if self.context is not None:
            self.context.land(self._finish_handles)
        else:
            self._finish_handles()
        size = self.backend.size
        with torch.no_grad():
            for segment, rows in zip(self.segments, gather.rows, strict=True):
                every = rows.view(segment.dtype).view(size, segment.items)
                for info in segment.params:
                    storage = info.whole.untyped_storage()
                    storage.resize_(info.padded.numel() * info.padded.element_size())
                    target = info.padded.data.view(size, info.items)
                    target.copy_(every[:, info.offset : info.offset + info.items])
        self._gather = None
        self.phase = _Phase.UNSHARDED
        self._put(sharded=False)

    def reshard(self) -> None:
        """Free the whole parameters and put the shards back in the module's place."""
        if self.phase is _Phase.GATHERING:  # a prefetch no forward used: land it first
            if self.context is not None:
                self.context.land(self._finish_handles)
            else:
                self._finish_handles()
            self._gather = None
        elif self.phase is _Phase.SHARDED:
            return
        for info in self.params:
            info.whole.untyped_storage().resize_(0)
        self.phase = _Phase.SHARDED
        self._put(sharded=True)

    # -- gradients ---------------------------------------------------------------------------

    def _begin_backward(self) -> None:
        self._ready = [not info.trainable for info in self.params]
        self._left = sum(info.trainable for info in self.params)
        self.reduced = False

    @property
    def ready(self) -> bool:
        return self._left == 0

    def on_grad(self, k: int) -> None:
        if self._ready[k]:
            return
        self._ready[k] = True
        self._left -= 1
        if self._left == 0 and self.context is not None:
            self.context.launch_ready()

    def mark_all_ready(self) -> None:
        self._ready = [True] * len(self.params)
        self._left = 0

    def reduce(self) -> None:
        """Reduce-scatter the whole gradients into the shards' `.grad` (or, without gradient
        sync, keep them); free the parameters unless a frozen one may still be read."""
        self.reduced = True
        if self.sync_gradients and any(info.trainable for info in self.params):
            self._reduce_scatter()
        # A frozen parameter may still be read by what backward has left to run (the gradient
        # of the module's input): such a group, and the root, are freed at the end of backward.
        root = self.context.root if self.context is not None else None
        if not self._has_frozen and self is not root:
            self.reshard()

    def _reduce_scatter(self) -> None:
        context = self.context
        assert context is not None
        context.before_call()
        context.land_reductions(keep=MAX_REDUCTIONS - 1)  # what they hold stays bounded
        size = self.backend.size
        landings: list[tuple[_Segment, list[_Param], torch.Tensor, Handle | None]] = []
        for segment in self.segments:
            trainable = [info for info in segment.params if info.trainable]
            if not trainable:
                continue
            width = segment.items + len(trainable)
            device = segment.data.device
            # Zeros where frozen parameters lie (never sent filled: no garbage reduced).
            make = torch.zeros if len(trainable) < len(segment.params) else torch.empty
            packed = make(size, width, dtype=segment.wire, device=device)
            with torch.no_grad():
                for j, info in enumerate(trainable):
                    region = packed[:, info.offset : info.offset + info.items]
                    grad = info.whole.grad
                    flag = packed[:, segment.items + j]
                    if grad is None:
                        region.zero_()
                        flag.zero_()
                        continue
                    flag.fill_(1)
                    flat = grad.reshape(-1)
                    if info.numel == size * info.items:
                        region.copy_(flat.view(size, info.items))
                    else:
                        region.zero_()
                        for r in range(size):
                            lo = r * info.items
                            n = min(info.items, info.numel - lo)
                            if n <= 0:
                                break
                            region[r, :n].copy_(flat[lo : lo + n])
                    info.whole.grad = None
            if self.staged:
                send = host_buffer(size * width, segment.wire, True)
                send.copy_(packed.view(-1))  # blocking: waits for the packing
            else:
                send = packed.view(-1)
            recv = host_buffer(width, segment.wire, self.staged)
            if size == 1:
                recv.copy_(send)
                handle = None
            else:
                handle = self.backend.ireduce_scatter(
                    _numpy(send), _numpy(recv), [width] * size, ReduceOp.SUM
                )
            landings.append((segment, trainable, recv, handle))

        def land() -> None:
            for segment, trainable, recv, handle in landings:
                if handle is not None:
                    handle.wait()
                received = recv if not self.staged else recv.to(segment.data.device)
                if size > 1:
                    received.mul_(1.0 / size)
                with torch.no_grad():
                    for j, info in enumerate(trainable):
                        if float(received[segment.items + j]) == 0:
                            continue  # no rank had a gradient: keep it as it is (None)
                        part = received[info.offset : info.offset + info.mine * info.row_items]
                        part = part.to(info.dtype).view(info.shard_shape())
                        if info.sharded.grad is None:
                            info.sharded.grad = part  # a view of what this call received
                        else:
                            info.sharded.grad.add_(part)
            landings.clear()

        context.in_flight(land, reduction=True)

    def close(self) -> None:
        self._cleanup()


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


def _on_grad(ref: weakref.ref[ShardGroup], k: int) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        group = ref()
        if group is not None and group.context is not None:
            group.context.on_grad(group, k)

    return hook


class _Context:
    """What the groups under one root share: the order they ran in, the calls in flight, and
    the state of the current backward. Made at the root's first forward (as FSDP2's lazy init).
    """

    def __init__(self, root: ShardGroup, groups: list[ShardGroup]) -> None:
        self.root, self.groups, self.backend = root, groups, root.backend
        self.order: list[ShardGroup] = []  # the groups in the order the last forward ran them
        self._forward: list[ShardGroup] = []  # this forward's, so far
        self.backward = False  # a backward through these groups is running
        self._pending: list[ShardGroup] = []  # this backward's groups not reduced yet, in order
        self._flights: list[Callable[[], None]] = []  # calls in flight: what lands each
        self._reductions: list[Callable[[], None]] = []  # the reduce-scatters among them

    # -- calls in flight ---------------------------------------------------------------------

    def before_call(self) -> None:
        """Before a call starts: where the engine does not move calls on by itself (MPI), the
        one in flight lands first."""
        if not self.backend.progresses:
            self.land_all()

    def in_flight(self, land: Callable[[], None], *, reduction: bool = False) -> None:
        self._flights.append(land)
        if reduction:
            self._reductions.append(land)

    def land_reductions(self, keep: int) -> None:
        """Land the reduce-scatters in flight but the last `keep` (each holds its send buffer,
        a module's gradients, until it lands)."""
        while len(self._reductions) > keep:
            self.land(self._reductions.pop(0))

    def land(self, land: Callable[[], None]) -> None:
        """Land the call that `land` lands, if in flight (where the engine does not move calls
        on by itself, every call started before it first: MPI completes them in order)."""
        if land not in self._flights:
            return
        if self.backend.progresses:
            self._flights.remove(land)
            land()
            return
        while self._flights:
            first = self._flights.pop(0)
            first()
            if first == land:
                return

    def land_all(self) -> None:
        self._reductions.clear()
        while self._flights:
            self._flights.pop(0)()

    # -- forward -----------------------------------------------------------------------------

    def pre_forward(self, group: ShardGroup) -> None:
        if group is self.root:
            self._forward = []
        if group not in self._forward:
            self._forward.append(group)
        group.unshard()
        ahead = _after(group, self.order)  # prefetch: the next module the last forward ran
        if ahead is not None:
            ahead.start_gather()

    def post_forward(self, group: ShardGroup, output: Out) -> Out:
        training = torch.is_grad_enabled()
        if group is self.root:
            self.order = list(self._forward)
            if not training:
                for other in self.groups:
                    other.reshard()
        elif group.reshard_after_forward:
            group.reshard()
        if training:
            ref = weakref.ref(self)
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(_before_backward(ref, group))
        return output

    # -- backward ----------------------------------------------------------------------------

    def _begin_backward(self) -> None:
        self.backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._pending = list(reversed(self.order))
        for group in self._pending:
            group._begin_backward()

    def pre_backward(self, group: ShardGroup) -> None:
        """The first gradient reached `group`'s outputs: gather it, prefetch the next."""
        if not self.backward:
            self._begin_backward()
        group.unshard()
        behind = _after(group, self.order[::-1])
        if behind is not None and not behind.reduced:
            behind.start_gather()

    def on_grad(self, group: ShardGroup, k: int) -> None:
        if not self.backward:
            self._begin_backward()
        group.on_grad(k)

    def launch_ready(self) -> None:
        """Reduce the groups whose gradients are all there, strictly in order."""
        while self._pending and self._pending[0].ready:
            self._pending.pop(0).reduce()

    def _end_backward(self) -> None:
        try:
            for group in self._pending:
                group.mark_all_ready()
            self.launch_ready()
            self.land_all()
            for group in self.groups:
                group.reshard()
        finally:
            self.backward = False
            self._pending = []


def _after(group: ShardGroup, order: list[ShardGroup]) -> ShardGroup | None:
    """The group after `group` in `order`, if any."""
    for k, other in enumerate(order[:-1]):
        if other is group:
            return order[k + 1]
    return None


def _tensors(output: object) -> Iterator[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


def _before_backward(
    ref: weakref.ref[_Context], group: ShardGroup
) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        context = ref()
        if context is not None:
            context.pre_backward(group)

    return hook


# -- the module's face --------------------------------------------------------------------


class FullyShardedModule(nn.Module):
    """What `fully_shard` makes of a module: the module's own class, with these methods.

    As torch's `FSDPModule`, the class of a module given to `fully_shard` becomes a subclass of
    both this and its own (`FullyShardLinear` for a `Linear`): `isinstance(m, nn.Linear)` holds
    still. Methods that gather or reduce are collective: call them on every rank.
    """

    _dp_group: ShardGroup

    def unshard(self) -> None:
        """Gather this module's parameters (its own group, not inner ones) and put them in its
        place until `reshard()` or the next forward's end (collective)."""
        self._dp_group.unshard()

    def reshard(self) -> None:
        """Free this module's gathered parameters; the shards take their place again."""
        self._dp_group.reshard()

    def to_empty(self, *, device: Any, recurse: bool = True) -> FullyShardedModule:
        """Give a model built on the meta device (`with torch.device("meta"):`) and sharded
        there memory on `device`, each rank for its own rows only: the whole parameters are
        never allocated, on any rank. The shards' values are unset (zeros): initialize them
        next (`reset_parameters()` of each module, which now sees this rank's rows, under a
        seed of each rank's own; or `dp.checkpoint.load`). Buffers and parameters no
        `fully_shard` took are made whole on `device`, as `nn.Module.to_empty` makes them.
        Not collective. Returns the module."""
        target = torch.device(device)
        groups = _groups(self) if recurse else [self._dp_group]
        for group in groups:
            group.materialize(target)
        taken = {id(info.sharded) for group in groups for info in group.params}
        modules = self.modules() if recurse else iter([self])
        for module in modules:
            for attr, param in module._parameters.items():
                if param is not None and id(param) not in taken:
                    with torch.no_grad():
                        empty = torch.empty_like(param, device=target)
                    module._parameters[attr] = nn.Parameter(empty, param.requires_grad)
            for attr, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[attr] = torch.empty_like(buffer, device=target)
        return self

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduce-scatters the gradients (True, the default) or keeps them
        whole on each rank until a backward with it True (accumulation without communication,
        at the memory of unsharded gradients; torch's FSDP2 method)."""
        for group in _groups(self) if recurse else [self._dp_group]:
            group.sync_gradients = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside the block, backward keeps the gradients whole instead of reducing them
        (`set_requires_gradient_sync(False)` for this module and the ones inside it); the first
        backward after it reduces their sum (as DDP's `no_sync`)."""
        groups = _groups(self)
        before = [g.sync_gradients for g in groups]
        for group in groups:
            group.sync_gradients = False
        try:
            yield
        finally:
            for group, sync in zip(groups, before, strict=True):
                group.sync_gradients = sync

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients of every parameter in this module by their norm over every
        rank's shard (collective), and return that norm.

        `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` would see this rank's shards
        only; this gives the value torch's gives on the whole gradients, NaN and infinities as
        torch (FSDP1's method of the same name). Call it after backward, before `step()`.
        """
        groups = _groups(self)
        shards = [info.sharded for group in groups for info in group.params]
        owned = [(k, p.grad) for k, p in enumerate(shards) if p.grad is not None]
        backend = self._dp_group.backend
        norm = clip_slices(
            owned, len(shards), max_norm, float(norm_type), error_if_nonfinite, backend
        )
        return torch.tensor(norm)

    def parameter_shards(self) -> dict[str, ParameterShard]:
        """This rank's shard of every parameter in this module, by the name `state_dict()`
        gives it, with where it sits in the whole parameter: what a sharded checkpoint writes
        from this rank (and loads into, in place). Buffers are not sharded: `state_dict()` has
        them whole on every rank."""
        infos = {id(info.sharded): info for group in _groups(self) for info in group.params}
        shards = {}
        for name, param in self.named_parameters():
            info = infos.get(id(param))
            if info is not None:
                shards[name] = ParameterShard(info.sharded, info.shape, info.offsets)
        return shards

    def commit_rows(
        self,
        optimizers: Mapping[str, torch.optim.Optimizer],
        *,
        exchange: bool = True,
        of: carry.Rows | None = None,
    ) -> carry.Rows:
        """A copy of this rank's rows of every parameter in this module and of `optimizers`'
        state for them (by name) and, with `exchange` (collective), of the next rank's: what
        `dp.elastic.TorchState` commits, so that a lost worker's rows outlive it. `of`: a
        commit made earlier in this layout, whose rows to exchange instead of today's.

        Raises:
            ValueError: the module shards over a group (`group=`), which a re-formed world
                cannot carry over.
        """
        if not self._dp_group.on_world:
            raise ValueError(
                f"{type(self).__name__} shards over a group (fully_shard(group=...)), which "
                "goes with its world: only a model sharded over the whole world is carried "
                "over to a re-formed one. Shard it over the world, or keep it in dp.checkpoint "
                "checkpoints."
            )
        backend = self._dp_group.backend
        return carry.record(_groups(self), optimizers, backend, exchange=exchange, of=of)

    def restore_rows(
        self, optimizers: Mapping[str, torch.optim.Optimizer], saved: carry.Rows
    ) -> bool:
        """Put back the rows `commit_rows` copied (not collective); False, changing nothing,
        where the module was laid out over another world since."""
        return carry.restore(_groups(self), optimizers, saved)

    def carry_over(
        self, optimizers: Mapping[str, torch.optim.Optimizer], saved: carry.Rows | None
    ) -> None:
        """Shard this module over the current world again and fill each rank's rows, and
        `optimizers`' state for them, from the survivors' `commit_rows` (collective: every
        rank of the new world, a newcomer with `saved=None`). The shards stay the same
        `nn.Parameter`s (of other shapes now): optimizers made on them keep working."""
        carry.carry_over(_groups(self), optimizers, saved, world.current().backend)

    def parameter_bytes(self) -> tuple[int, int]:
        """Bytes of parameters this rank holds now for this module: its shards, and the whole
        parameters and gradients gathered or kept at this moment (0 between steps)."""
        groups = _groups(self)
        return sum(g.sharded_bytes for g in groups), sum(g.gathered_bytes for g in groups)


def _groups(module: nn.Module) -> list[ShardGroup]:
    """The groups of `module` and of every sharded module inside it, in registration order."""
    return [m._dp_group for m in module.modules() if isinstance(m, FullyShardedModule)]


_classes: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    made = _classes.get(cls)
    if made is None:
        made = type(f"FullyShard{cls.__name__}", (FullyShardedModule, cls), {})
        _classes[cls] = made
    return made


def fully_shard(
    module: M,
    *,
    reshard_after_forward: bool = True,
    group: Group | None = None,
    backend: Backend | None = None,
    _staged: bool = False,
) -> M:
    """Shard `module`'s parameters across ranks (ZeRO stage 3), as torch's FSDP2 `fully_shard`.

    Apply it to each block first, then to the whole model: each call takes the parameters its
    module holds that no inner call took (tied parameters must be taken together: apply it to
    the module that holds both places). Between uses every rank keeps only its rows of each
    parameter; a module's parameters are gathered just before its forward and again before its
    backward, and freed after; gradients are reduce-scattered (averaged) as each module's
    backward ends, into this rank's shards' `.grad`. Make the optimizer after this call, on
    `model.parameters()`: any torch optimizer then steps this rank's shards only.

    Args:
        module: the module; its class becomes a `FullyShardedModule` subclass of its own.
        reshard_after_forward: free the gathered parameters after the forward and gather them
            again for backward (default, least memory); False keeps them until backward used
            them. The outermost module keeps them either way (it is gathered first in backward).
        group: shard over a `dp.new_group` instead of the world.
        backend: the engine to use (default: the active one).

    Returns:
        `module` itself.

    Raises:
        ValueError: it was sharded already, or a parameter tied to one an inner call took.

    Every rank must start from the same parameters (the same seed; `dp.synchronize(model)`
    before this call, else) and run the same modules in the same order. Usage: docs/zero.md.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes a torch.nn.Module, got {type(module).__name__}.")
    if isinstance(module, FullyShardedModule):
        raise ValueError(
            f"fully_shard: this {type(module).__name__} is sharded already; apply fully_shard "
            "once per module."
        )
    engine = backend_of(backend, group) or world.current().backend
    named: list[tuple[str, nn.Parameter]] = []
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for prefix, inner in module.named_modules():
        for attr, param in inner._parameters.items():
            if param is None or getattr(param, "_dp_shard", None) is not None:
                continue  # an inner call's shard
            name = f"{prefix}.{attr}" if prefix else attr
            taken = getattr(param, "_dp_taken_by", None)
            if taken is not None and taken() is not None:
                raise ValueError(
                    f"fully_shard({type(module).__name__}): parameter {name!r} is tied to one "
                    "that an inner fully_shard call took already, so it would be sharded twice "
                    "and the two copies would drift apart. Apply fully_shard to the module "
                    "that holds both places, not to the inner one."
                )
            if id(param) not in places:
                places[id(param)] = []
                named.append((name, param))
            places[id(param)].append((inner, attr))
    staged = _staged or any(p.device.type not in ("cpu", "meta") for _, p in named)
    made = ShardGroup(
        module,
        named,
        places,
        engine,
        reshard_after_forward=reshard_after_forward,
        staged=staged,
    )
    for info, (_, original) in zip(made.params, named, strict=True):
        original._dp_taken_by = weakref.ref(made)  # type: ignore[attr-defined]
        info.sharded._dp_shard = weakref.ref(made)  # type: ignore[attr-defined]
    made.on_world = engine is world.current().backend
    module.__class__ = _sharded_class(type(module))
    setattr(module, "_dp_group", made)  # noqa: B010 - not a tensor or module: a plain attribute
    module.register_forward_pre_hook(_pre_forward, prepend=True)
    module.register_forward_hook(_post_forward)
    return module


def _pre_forward(module: nn.Module, _: object) -> None:
    group: ShardGroup = module._dp_group  # type: ignore[assignment]
    if group.context is None:
        _make_root(group)
    assert group.context is not None
    group.context.pre_forward(group)


def _post_forward(module: nn.Module, _: object, output: Out) -> Out:
    group: ShardGroup = module._dp_group  # type: ignore[assignment]
    assert group.context is not None
    return group.context.post_forward(group, output)


def _make_root(root: ShardGroup) -> None:
    """Make `root` (the first sharded module whose forward runs) the root of the groups inside
    it, and check what the groups hold."""
    groups = [g for g in _groups(root.module) if g.context is None]
    # Every module's parameters must belong to the group of its nearest sharded module
    # (itself or an ancestor): otherwise a module would read another group's shard.
    group_of = {id(info.sharded): g for g in groups for info in g.params}
    _check_places(root.module, root, group_of)
    for g in groups:
        for info in g.params:
            if owner_of(info.sharded) is not None:
                raise ValueError(
                    f"fully_shard: parameter {info.name!r} is also reduced by a "
                    "DataParallelModel or DistributedOptimizer, which would average its "
                    "gradients a second time. A fully sharded model reduces its gradients "
                    "itself: give its parameters to a plain torch optimizer."
                )
    context = _Context(root, groups)
    for g in groups:
        g.context = context


def _check_places(
    module: nn.Module, governing: ShardGroup, group_of: dict[int, ShardGroup]
) -> None:
    if isinstance(module, FullyShardedModule):
        governing = module._dp_group
    for attr, param in module._parameters.items():
        owner = group_of.get(id(param)) if param is not None else None
        if owner is not None and owner is not governing:
            raise ValueError(
                f"fully_shard: {type(module).__name__}.{attr} is a parameter that "
                f"fully_shard({type(owner.module).__name__}) took, but this module is not "
                "inside that one (a parameter tied across sharded modules): apply fully_shard "
                "to a module holding both places instead."
            )
    for child in module.children():
        _check_places(child, governing, group_of)
