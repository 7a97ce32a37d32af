"""FP8 all-gather under FSDP2 (``torch.distributed.fsdp.fully_shard``).

Without it FSDP2 gathers each weight in its own (or ``MixedPrecisionPolicy.param_dtype``'s)
precision and the ops cast the unsharded weight to FP8, once per unshard (the weight cache; see
``FP8StateMixin._parameter_swapped``). With it the sharded weight is cast to FP8 before the
all-gather, which then moves one byte per element, and the gathered FP8 weight is what the GEMMs
read:

* :func:`enable_fp8_all_gather` (before ``fully_shard``) makes the weight of every ``Linear``,
  ``BasicLinear`` and ``GroupedLinear`` a :class:`Float8AllGatherWeight`: a tensor subclass around
  the high-precision weight (what FSDP2 shards, the optimizer updates and ``state_dict`` holds)
  whose ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` FSDP2 calls at every unshard.
* ``fsdp_pre_all_gather`` casts this rank's shard under the active recipe (in backward: the recipe
  of the forward that last gathered it) with the scale the whole weight would get, so the gathered
  bytes and scales equal those of casting the unsharded weight (bit for bit, every recipe):

  - per-tensor recipes: the scale comes from the global amax, the max of every rank's shard amax
    (one all-reduce over the FSDP group; :func:`precompute_fp8_scales` after the optimizer step
    makes it one all-reduce for all weights);
  - delayed scaling: as current scaling (a weight's delayed scale is its current amax), the
    amax recorded in the owner's history as the unsharded cast records it;
  - block scaling: 128x128 blocks need no communication when every rank holds whole blocks
    (dense weights: out_features divisible by 128 * ranks; expert weights: experts divisible by
    the ranks); otherwise a ``ValueError`` names the recipe and the shapes.

* ``fsdp_post_all_gather`` returns a :class:`Float8GatheredWeight`, the unsharded parameter
  FSDP2 swaps in: FP8 bytes and scales standing for a tensor of the parameter's dtype (its
  gradient is an ordinary tensor of that dtype, which FSDP2 reduce-scatters as usual).

FSDP2 fixes a parameter's all-gather layout at its first unshard, so a weight once gathered under
a per-tensor recipe cannot be gathered under block scaling later (and the reverse): a
``RuntimeError`` names both recipes. An unshard outside ``fo.autocast`` (no recipe) raises too:
the weight is gathered in FP8 and only FP8 calls read it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._pytree import tree_map_only

from ..kernels.fp8_cast import BLOCK, cast_block, cast_tensor, tensor_amax
from .casting import FP8StateMixin, _is_dtensor, weight_scale
from .recipes import E4M3, Float8BlockScaling, Float8DelayedScaling, current_recipe
from .tensor import Float8Tensor, dequantize_2d


class Float8AllGatherWeight(torch.Tensor):
    """A weight that FSDP2 all-gathers in FP8 (see the module docstring): a wrapper around the
    high-precision tensor ``hp`` (what FSDP2 shards). The ops FSDP2 shards and pads with
    (views, ``new_zeros``, ``copy_``...) keep the type, so the rank's shard carries the hooks; any
    other op (the optimizer's math, a forward without FSDP2) runs on ``hp`` and returns plain
    tensors. Made by :func:`enable_fp8_all_gather`. Kept on the shard between unshards: the recipe
    of the last forward unshard, the all-gather layout, and the amax :func:`precompute_fp8_scales`
    took."""

    @staticmethod
    def __new__(cls, hp: torch.Tensor, state: Optional[dict] = None):
        self = torch.Tensor._make_wrapper_subclass(cls, hp.shape, strides=hp.stride(), storage_offset=hp.storage_offset(),
                                                   dtype=hp.dtype, device=hp.device, requires_grad=hp.requires_grad)
        self._hp = hp
        self._fp8_ag = {} if state is None else state
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        state = []

        def plain(t):
            state.append(t._fp8_ag)
            return t._hp

        first = args[0] if args else None
        args, kwargs = tree_map_only(cls, plain, (args, kwargs or {}))
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name.endswith("_") and type(first) is cls:  # in place (copy_, the optimizer's updates): on hp
            return first
        if name in _VIEWS:  # (a view of the same weight: the same state)
            return tree_map_only(torch.Tensor, lambda t: cls(t, state[0]), out)
        if name in _COPIES:
            return tree_map_only(torch.Tensor, cls, out)
        return out

    def __repr__(self) -> str:
        return f"Float8AllGatherWeight({self._hp!r})"

    def __tensor_flatten__(self):
        return ["_hp"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8AllGatherWeight(inner["_hp"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The FP8 bytes of this rank's shard (uint8, padded to FSDP2's shard size) and, under
        block scaling on 2+ ranks, its block scales; the metadata carries the rest."""
        state = self._fp8_ag
        recipe = _recipe_for_unshard(state, module)
        layout = "128x128" if isinstance(recipe, Float8BlockScaling) else "tensor"
        if state.setdefault("layout", (layout, recipe))[0] != layout:
            raise RuntimeError(
                f"{_name(module)}: FP8 all-gather: this weight was gathered under {type(state['layout'][1]).__name__} "
                f"({state['layout'][0]} scales) and FSDP2 fixes a parameter's all-gather layout at its first unshard; "
                f"it cannot be gathered under {type(recipe).__name__} ({layout} scales). Use one scaling layout per "
                f"model, or build the model again.")
        world = mesh.size()
        param_dtype = getattr(mp_policy, "param_dtype", None) or self.dtype
        shard = self._hp.detach().to(param_dtype)
        rows2d = shard.reshape(-1, shard.shape[-1]) if shard.dim() > 1 else shard.reshape(-1, 1)
        grouped = len(outer_size) == 3
        with torch.no_grad():
            if layout == "128x128":
                _check_block_shards(module, recipe, outer_size, world)
                q, inv, _, _ = cast_block(rows2d, square=True, pow2=recipe.power_of_two_scales)
                _count_cast(module)
                if world > 1:
                    return (q.view(torch.uint8).view(shard.shape), inv), ("128x128", None, grouped, None)
                return (q.view(torch.uint8).view(shard.shape),), ("128x128", inv, grouped, None)
            amax = _global_amax(self, module, mesh, param_dtype)
            inv = torch.empty(1, dtype=torch.float32, device=shard.device)
            if isinstance(recipe, Float8DelayedScaling):  # (the GEMM's call records it: fp8_form)
                q, _ = cast_tensor(rows2d, weight_scale(module, recipe, amax, False), E4M3, False, inv=inv)
            else:
                q, _ = cast_tensor(rows2d, amax, E4M3, False, from_amax=True, inv=inv)
            _count_cast(module)
        padded = -(-outer_size[0] // world)
        data = q.view(torch.uint8).view(shard.shape)
        if data.shape[0] != padded:  # (uneven sharding: FSDP2 gathers every rank's padded shard)
            data = torch.cat([data, data.new_zeros(padded - data.shape[0], *data.shape[1:])])
        return (data,), ("tensor", inv.reshape(()), grouped, amax)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered FP8 weight (``out``: the one FSDP2 made at the first unshard, refilled)."""
        layout, inv, grouped, amax = metadata
        data = outputs[0].view(E4M3)
        if inv is None:  # (block scales gathered with the bytes)
            inv = outputs[1]
        if out is not None:
            out._refill(inv, amax)
            return None
        w = Float8GatheredWeight(data, inv, param_dtype, data.shape, scaling=layout, grouped=grouped)
        w._amax = amax
        return w, tuple(outputs)


# what FSDP2 applies to a parameter it shards (and nn.Parameter's detach): these keep the type
_VIEWS = frozenset({"detach", "alias", "view", "slice", "split", "split_with_sizes", "as_strided", "_unsafe_view"})
_COPIES = frozenset({"new_zeros", "new_empty", "empty_like", "_to_copy", "clone", "_pin_memory"})


def _recipe_for_unshard(state: dict, module):
    """The recipe to gather under: the active one in forward (kept for backward), the kept one in
    backward (FSDP2 gathers again before backward, outside the ``autocast`` block)."""
    if _in_backward():
        recipe = state.get("recipe")
        if recipe is None:
            raise RuntimeError(f"{_name(module)}: FP8 all-gather in backward of a weight no forward gathered")
        return recipe
    recipe = current_recipe()
    if recipe is None:
        raise RuntimeError(
            f"{_name(module)}: FP8 all-gather (fusible_ops.quantization.enable_fp8_all_gather) gathers this weight "
            f"in FP8, so it must be unsharded inside fusible_ops.autocast(recipe=...): run the forward under "
            f"autocast (evaluation too), or build the model without enable_fp8_all_gather.")
    state["recipe"] = recipe
    return recipe


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _name(module) -> str:
    return type(module).__name__


def _count_cast(owner) -> None:
    owner.__dict__["fp8_weight_casts"] = owner.__dict__.get("fp8_weight_casts", 0) + 1


def _check_block_shards(module, recipe, outer_size, world: int) -> None:
    if len(outer_size) == 3:  # experts' weights [G, N, K]: whole experts per rank
        ok, what = outer_size[0] % world == 0, f"the expert count ({outer_size[0]}) divisible by {world} ranks"
    else:
        ok = outer_size[0] % (BLOCK * world) == 0
        what = f"out_features ({outer_size[0]}) divisible by {BLOCK} * {world} ranks"
    if not ok:
        raise ValueError(
            f"{_name(module)}: FP8 all-gather under {type(recipe).__name__} needs every rank's rows to be whole "
            f"{BLOCK}x{BLOCK} weight blocks, i.e. {what}. Use a per-tensor recipe (Float8CurrentScaling, "
            f"Float8DelayedScaling) with FP8 all-gather, or gather this weight in high precision (leave it out of "
            f"enable_fp8_all_gather).")


def _version_key(shard: Float8AllGatherWeight, owner) -> tuple:
    """What changes when the weight does: the version of the sharded ``DTensor`` parameter (the
    optimizer's updates bump it, not the shard's) and of the shard's tensor (an in-place load into
    it); None for the first when ``owner``'s weight is not that parameter."""
    p = owner._parameters.get("weight")
    return (p._version if getattr(p, "_local_tensor", None) is shard else None, shard._hp._version)


def _global_amax(shard: Float8AllGatherWeight, owner, mesh, param_dtype) -> torch.Tensor:
    """The whole weight's amax (in ``param_dtype``'s rounding): the one taken since the weight last
    changed (by :func:`precompute_fp8_scales`, or by this weight's previous unshard), else this
    shard's amax max-reduced over the FSDP group (one all-reduce), kept for the next unshards."""
    key = _version_key(shard, owner)
    kept = shard._fp8_ag.get("amax")
    if kept is None or kept[0] != key or key[0] is None:
        amax = tensor_amax(shard._hp)
        if mesh.size() > 1:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
        kept = (key, amax)
        shard._fp8_ag["amax"] = kept
    return kept[1].to(param_dtype).float()


def precompute_fp8_scales(model: torch.nn.Module) -> int:
    """After each optimizer step (which changes the weights): the global amax of every FP8
    all-gather weight of ``model`` (sharded by ``fully_shard``) that changed, in one all-reduce per
    FSDP group, so that its next unshards reduce nothing. Without it each weight's first FP8
    all-gather after a change all-reduces its own amax (the same values: this only saves
    collectives). Returns the number of weights whose amax was taken."""
    groups: dict = {}
    for m in model.modules():
        p = m._parameters.get("weight")
        shard = getattr(p, "_local_tensor", None)
        if type(shard) is not Float8AllGatherWeight:
            continue
        key = _version_key(shard, m)
        kept = shard._fp8_ag.get("amax")
        if kept is not None and kept[0] == key:
            continue
        dims = [i for i, pl in enumerate(p.placements) if pl.is_shard()]
        group = p.device_mesh.get_group(dims[0]) if dims else None
        groups.setdefault(group, []).append((shard, key))
    for group, shards in groups.items():
        amaxes = torch.cat([tensor_amax(s._hp) for s, _ in shards])
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
        for i, (s, key) in enumerate(shards):
            s._fp8_ag["amax"] = (key, amaxes[i : i + 1])
    return sum(len(s) for s in groups.values())


class Float8GatheredWeight(Float8Tensor):
    """The unsharded weight FSDP2 gathered in FP8: the bytes of the whole weight (experts' weights
    [G, N, K] included) with its scales (one per tensor, or one per 128x128 block of the rows
    flattened to [rows, K]), standing for a tensor of the parameter's dtype. The ops read its FP8
    forms through the weight cache (:meth:`fp8_form`; the transposed copy once per unshard); any
    other torch op sees the dequantized values. ``detach`` / ``alias`` / ``as_strided`` (what FSDP2
    applies to it) keep the type."""

    fp8_gathered = True

    @staticmethod
    def __new__(cls, data, scale_inv, dtype, shape, *, scaling: str, grouped: bool = False, requires_grad=False):
        self = Float8Tensor.__new__(cls, data, scale_inv, dtype, shape, scaling=scaling, requires_grad=requires_grad)
        self._grouped = grouped
        self._generation = 0
        self._amax = None  # (per-tensor layouts: the whole weight's amax, which delayed scaling records)
        return self

    def _refill(self, scale_inv: torch.Tensor, amax: Optional[torch.Tensor]) -> None:
        """A new unshard filled the bytes in place (FSDP2 reuses their memory): take its scales."""
        if self._scaling == "tensor":
            self._scale_inv = scale_inv
        self._amax = amax
        self._generation += 1

    def _like(self, data: torch.Tensor, shape) -> "Float8GatheredWeight":
        w = Float8GatheredWeight(data, self._scale_inv, self.dtype, shape, scaling=self._scaling, grouped=self._grouped)
        w._amax = self._amax
        return w

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._like(args[0]._data, args[0].shape)
        if func is aten.as_strided.default:
            self, size, stride = args[0], tuple(args[1]), tuple(args[2])
            offset = args[3] if len(args) > 3 else (kwargs or {}).get("storage_offset", 0)
            if self._scaling == "tensor" or size == tuple(self.shape):
                return self._like(self._data.as_strided(size, stride, offset), size)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        rows = self._data.reshape(-1, self._data.shape[-1])
        return dequantize_2d(rows, self._scale_inv, self._scaling).to(dtype or self.dtype).reshape(self.shape)

    def fp8_form(self, owner: torch.nn.Module, recipe, transposed: bool, grouped: bool, record: bool) -> Float8Tensor:
        """The weight as the ops read it (what ``cached_weight`` returns for a weight it casts),
        with the transposed copy when ``transposed``; kept in ``owner``'s weight cache until the
        next unshard or reshard. Under delayed scaling a training call (``record``) records the
        weight's amax in ``owner``'s state, as the cast of the unsharded weight would."""
        key = ("gathered", id(self), self._generation, transposed, grouped, record)
        hit = owner.__dict__.get("_fp8_weight_cache")
        if hit is not None and hit[0] == key:
            return hit[1]
        if record and isinstance(recipe, Float8DelayedScaling) and self._amax is not None:
            weight_scale(owner, recipe, self._amax, True)
        data, inv, recipe = self._data, self._scale_inv, None
        if grouped:
            g, n, k = data.shape
            data_t = data.view(torch.uint8).transpose(1, 2).contiguous().view(data.dtype) if transposed else None
            if self._scaling == "tensor":
                wq = Float8Tensor(data, inv, self.dtype, self.shape, scaling="tensor", data_t=data_t,
                                  scale_inv_t=inv if transposed else None, recipe=recipe)
            else:
                inv = inv.view(g, n // BLOCK, inv.shape[-1])
                wq = Float8Tensor(data, inv, self.dtype, self.shape, scaling="128x128", data_t=data_t,
                                  scale_inv_t=inv.transpose(1, 2).contiguous() if transposed else None, recipe=recipe)
        else:
            data_t = data.view(torch.uint8).t().contiguous().view(data.dtype) if transposed else None
            inv_t = (inv if self._scaling == "tensor" else inv.t().contiguous()) if transposed else None
            wq = Float8Tensor(data, inv, self.dtype, self.shape, scaling=self._scaling, data_t=data_t,
                              scale_inv_t=inv_t, recipe=recipe)
        owner.__dict__["_fp8_weight_cache"] = (key, wq)
        return wq


def enable_fp8_all_gather(model: torch.nn.Module) -> int:
    """Make FSDP2 all-gather the FP8 weights of ``model`` in FP8 (see the module docstring): the
    weight of every ``Linear``, ``BasicLinear`` and ``GroupedLinear`` becomes a
    :class:`Float8AllGatherWeight` (same values, same ``requires_grad``). Call it before
    ``fully_shard``; every forward must then run inside ``fusible_ops.autocast`` with a recipe.
    Returns the number of weights converted."""
    n = 0
    for m in model.modules():  # (the modules owning a weight the ops cast: a BasicLinear inside a
        w = m._parameters.get("weight")  # Linear borrows it, the Linear holds it)
        if not isinstance(m, FP8StateMixin) or w is None or isinstance(w, Float8AllGatherWeight):
            continue
        if _is_dtensor(w):
            raise RuntimeError(f"enable_fp8_all_gather: {_name(m)}'s weight is already sharded; call it before "
                               f"fully_shard")
        new = torch.nn.Parameter(Float8AllGatherWeight(w.detach()), requires_grad=w.requires_grad)
        m._parameters["weight"] = new
        m.__dict__.pop("_fp8_weight_cache", None)
        m.register_state_dict_post_hook(_plain_in_state_dict)
        n += 1
    return n


def _plain_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """``state_dict()`` holds the weight's plain tensor (a ``DTensor`` of it once sharded), sharing
    its memory: checkpoints are the same with or without FP8 all-gather, and a loader that fills
    the state dict's tensors in place (``torch.distributed.checkpoint``) fills the weight."""
    key = prefix + "weight"
    t = state_dict.get(key)
    local = getattr(t, "_local_tensor", None)
    if type(local) is Float8AllGatherWeight:
        from torch.distributed.tensor import DTensor

        state_dict[key] = DTensor.from_local(local._hp, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                             stride=t.stride())
    elif isinstance(t, Float8AllGatherWeight):
        state_dict[key] = t._hp


__all__ = ["Float8AllGatherWeight", "Float8GatheredWeight", "enable_fp8_all_gather", "precompute_fp8_scales"]
