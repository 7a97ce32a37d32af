"""Delayed scaling's per-call state updates, batched per fuser: one launch per call direction.

Each cast of an input or output gradient under :class:`~.recipes.Float8DelayedScaling` first
updates its role's scale from the amax history and rolls the history (``casting._delayed_scale``).
Done cast by cast, that is one launch (and its Python) per FP8 tensor. Here a fuser's training
calls do all of a direction's updates at once, before the steps run:

* **One buffer.** The delayed-scaling state of the modules a fuser's casts record into (each
  ``fp8_amax_history`` [L, 3] and ``fp8_scale`` [3], see ``casting``) is held in one buffer pair
  per fuser, :class:`DelayedPack` (``hist`` [n, L + 2, 3], ``scale`` [n, 3]; layout in
  :mod:`fusible_ops.kernels.fp8_delayed`). Each module's two buffers become views into it, so its
  state-dict keys and values, ``load_state_dict`` (in place) and what a reader of the attributes
  sees are unchanged.
* **Learned per plan.** The first training call of a plan (per direction, and per whether its
  input is already FP8) runs cast by cast and notes which modules' input (forward) or
  output-gradient (backward) columns it updated. Every later call of that plan updates exactly
  those columns in one launch (:func:`~fusible_ops.kernels.fp8_delayed.delayed_update_many`)
  and hands each module its scale and history entry (a token the cast takes in place of its own
  update). The values are those of the cast-by-cast updates, bit for bit: each column's update
  reads only its own history, which no other cast of the call touches.
* **Checked.** A token left untaken when the steps end (an exception inside the call, or a call
  that cast fewer tensors than the plan's earlier ones) is taken back exactly (the update keeps
  what it overwrote); in the second case the plan goes back to cast-by-cast updates for good. A
  cast that finds no token updates its column itself, as before.

Not batched (cast by cast, as before): calls traced by ``torch.compile`` (the state must not be
re-registered inside a trace), calls that are not training calls (they record nothing), a plan
whose casts record one module's column twice (tied weights), and calls outside the fuser's
autograd function (MoE routing's steps, calls with no gradient). Under an ``amax_reduction_group``
each cast reduces its entry as it records it (:func:`.casting.reduce_amax`), so the batched update
reads the group's max.
"""

from __future__ import annotations

import os
import weakref
from typing import Optional

import torch

from ..kernels.fp8_delayed import UpdateMany, delayed_undo_ref
from .casting import _ARMED, _HISTORY, _SCALE, _WATCH, delayed_state
from .recipes import FP8_MAX, ROLES, fp8_dtype
from .tensor import is_float8


_CAPTURED = "_fp8_captured"  # (in a module's __dict__: a CUDA graph captured its delayed-scaling buffers)


def fuser_owners(fuser) -> list:
    """The modules that may hold the delayed-scaling state of ``fuser``'s ops: the module owning
    each op's weight (the op itself for an op without one, e.g. ``Quantize``)."""
    return [op.param_owner("weight") if "weight" in op.param_names() else op for op in fuser.ops]


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


ENABLED = os.environ.get("FUSIBLE_OPS_FP8_BATCHED_UPDATES", "1") != "0"
"""Batch the delayed-scaling updates of a fuser's calls (module doc). ``FUSIBLE_OPS_FP8_BATCHED_UPDATES=0``
(or setting this to False) makes every cast update its own column, as outside a fuser."""


class _Learned:
    """The columns one plan's calls update in one direction: owners (weakly), and their indices in
    the pack (an int32 device tensor, remade when the pack is rebuilt)."""

    __slots__ = ("plan", "owners", "recipe", "r", "fmax", "gen", "idx", "pos", "update")

    def __init__(self, plan, owners: list, recipe, r: int) -> None:
        self.plan = weakref.ref(plan)  # (the key holds its id: a later plan with the same id is not it)
        self.owners = [weakref.ref(o) for o in owners]
        self.recipe = recipe
        self.r = r
        self.fmax = FP8_MAX[fp8_dtype(recipe, ROLES[r])] / (2.0 ** recipe.margin)
        self.gen = -1  # the pack generation idx/pos were made for
        self.idx: Optional[torch.Tensor] = None
        self.pos: list[int] = []
        self.update: Optional[UpdateMany] = None


class DelayedPack:
    """The delayed-scaling state of one fuser's modules in one buffer pair (module doc). Dropped
    by ``copy.deepcopy`` and pickling: a copy builds its own from its modules' buffers."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.owners: list = []  # weakrefs, pack order
        self.hist: Optional[torch.Tensor] = None  # [n, L + 2, 3]
        self.scale: Optional[torch.Tensor] = None  # [n, 3]
        self.views: list = []  # per owner: (history view, scale view), what its buffers must be
        self.tokens: list = []  # per owner: [(scale[r], newest entry[r]) or None for r in roles]
        self.gen = 0
        self.learned: dict = {}  # (id(plan), r, input is FP8) -> _Learned, or False: never batched
        self.updates = 0  # batched updates launched (tests read it)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._reset()

    # -- the buffer -----------------------------------------------------------------------
    def _valid(self, k: int, owner, L: int, device) -> bool:
        """Whether owner ``k``'s buffers are still this pack's views (no ``.to()``, no re-creation)."""
        h, s = self.views[k]
        b = owner._buffers
        return b.get(_HISTORY) is h and b.get(_SCALE) is s and h.shape[0] == L and h.device == device

    def _rebuild(self, need: list, others: list, recipe, device) -> None:
        """A new buffer pair holding ``need`` (owners), this pack's owners still valid at this
        history length and device, and ``others`` (owners of the fuser's other ops already holding
        state of this length on this device: taken in now, so another plan of the fuser finds them
        placed). Each one's buffers become views into it (values copied). Owners whose buffers a
        CUDA graph captured are never moved: they stay out."""
        L = recipe.amax_history_len
        owners, seen = list(need), {id(o) for o in need}
        for k, ref in enumerate(self.owners):
            o = ref()
            if o is None:
                continue
            if id(o) not in seen and self._valid(k, o, L, device) and not o.__dict__.get(_CAPTURED):
                owners.append(o)
                seen.add(id(o))
            elif id(o) not in seen:
                o.__dict__.pop(_ARMED, None)
        for o in others:
            h = o._buffers.get(_HISTORY)
            if (id(o) not in seen and not o.__dict__.get(_CAPTURED) and h is not None and h.shape[0] == L
                    and h.device == device and o._buffers.get(_SCALE) is not None):
                owners.append(o)
                seen.add(id(o))
        for o in need:
            delayed_state(o, recipe, device)  # (created, or re-created at this length, as a cast would)
        n = len(owners)
        hist = torch.zeros(n, L + 2, len(ROLES), dtype=torch.float32, device=device)
        scale = torch.empty(n, len(ROLES), dtype=torch.float32, device=device)
        views, tokens = [], []
        with torch.no_grad():
            for k, o in enumerate(owners):
                h, s = hist[k, :L], scale[k]
                h.copy_(o._buffers[_HISTORY])
                s.copy_(o._buffers[_SCALE])
                o._buffers[_HISTORY], o._buffers[_SCALE] = h, s  # (same names, persistence, state-dict entries)
                o.__dict__[_ARMED] = [None] * len(ROLES)
                views.append((h, s))
                tokens.append([(s[r : r + 1], h[0:1, r]) for r in range(len(ROLES))])
        self.owners = [weakref.ref(o) for o in owners]
        self.hist, self.scale, self.views, self.tokens = hist, scale, views, tokens
        self.gen += 1

    def _place(self, learned: _Learned, owners: list, device, fuser, capturing: bool) -> bool:
        """Whether the pack holds ``learned``'s owners (``owners``, alive) as its views, rebuilt
        when it does not hold them all or some moved. Not while a CUDA graph captures (that would
        allocate and copy inside the graph), nor when an owner a graph captured would move."""
        L = learned.recipe.amax_history_len
        ok = learned.gen == self.gen
        if ok:
            views = self.views
            for k, o in zip(learned.pos, owners):  # (what _valid checks, inline: this runs per call)
                h, s = views[k]
                b = o._buffers
                if b.get(_HISTORY) is not h or b.get(_SCALE) is not s or h.device != device:
                    ok = False
                    break
        if ok:
            return True
        if capturing:
            return False
        where = {id(ref()): k for k, ref in enumerate(self.owners)}
        pos = [where.get(id(o), -1) for o in owners]
        if any(k < 0 or not self._valid(k, o, L, device) for k, o in zip(pos, owners)):
            if any(o.__dict__.get(_CAPTURED) for o in owners):
                return False
            self._rebuild(owners, fuser_owners(fuser), learned.recipe, device)
            where = {id(ref()): k for k, ref in enumerate(self.owners)}
            pos = [where[id(o)] for o in owners]
        learned.pos = pos
        learned.idx = torch.tensor(pos, dtype=torch.int32, device=device)
        learned.update = UpdateMany(self.hist, self.scale, learned.idx, learned.r, learned.fmax,
                                    learned.recipe.amax_compute_algo == "max")
        learned.gen = self.gen
        return True

    # -- a call ---------------------------------------------------------------------------
    def begin(self, fuser, plan, key: tuple, r: int, device):
        """Before a direction's steps: the batched update (and the tokens), or a watch that learns
        the plan's columns. Returns the handle for :meth:`end` (``("none",)``: neither, the steps
        update cast by cast). Pushes the watch (None when not learning) that :meth:`end` pops."""
        capturing = _capturing(device)
        if capturing:  # (the graph keeps pointers into the modules' buffers: they must never move)
            for o in fuser_owners(fuser):
                o.__dict__[_CAPTURED] = True
        learned = self.learned.get(key)
        if learned is not None and learned is not False and learned.plan() is not plan:
            learned = None  # (an earlier plan's, with the same id)
        if learned is None and not capturing:
            watch: list = []
            _WATCH.stack.append(watch)
            return ("learn", key, watch, plan, r)
        _WATCH.stack.append(None)  # (nested casts cast by cast are not this call's to learn)
        if not learned:
            return ("none",)
        owners = []
        for ref in learned.owners:
            o = ref()
            if o is None:  # (a module is gone: learn again)
                del self.learned[key]
                return ("none",)
            owners.append(o)
        if not self._place(learned, owners, device, fuser, capturing):
            return ("none",)
        # (under an amax_reduction_group every cast reduced its entry as it recorded it: the newest
        # entries are the group's max already)
        learned.update()
        self.updates += 1
        tokens = self.tokens
        for k, o in zip(learned.pos, owners):
            o.__dict__[_ARMED][r] = tokens[k][r]
        return ("packed", learned, owners)

    def end(self, handle, ok: bool) -> None:
        """After a direction's steps (``ok``: they returned): keep what a learning call saw, or
        check that every token was taken (taking back the updates of those that were not)."""
        _WATCH.stack.pop()
        if handle[0] == "learn":
            _, key, watch, plan, r = handle
            if ok:
                self.learned[key] = self._learn(plan, watch, r)
            return
        if handle[0] == "none":
            return
        _, learned, owners = handle
        r, missed = learned.r, False
        for k, o in zip(learned.pos, owners):
            armed = o.__dict__.get(_ARMED)
            if armed is not None and armed[r] is not None:
                armed[r] = None
                delayed_undo_ref(self.hist, self.scale, k, r)
                missed = True
        if missed and ok:  # (a call of this plan cast fewer tensors than its first: not batched any more)
            for key, v in self.learned.items():
                if v is learned:
                    self.learned[key] = False
                    break

    @staticmethod
    def _learn(plan, watch: list, r: int):
        """The :class:`_Learned` of a learning call's updates, or False when they cannot be batched."""
        owners, seen = [], set()
        for owner, role in watch:
            if role != r or id(owner) in seen:  # (another direction's column, or one column twice)
                return False
            seen.add(id(owner))
            owners.append(owner)
        return _Learned(plan, owners, plan.fp8_delayed, r) if owners else False


def run_batched(fuser, plan, r: int, x: torch.Tensor, fn, *args):
    """``fn(*args)`` (a fuser's forward steps, ``r`` 0, or its backward, ``r`` 2) with the
    direction's delayed-scaling updates batched (module doc). ``x``: the forward's input (its
    device is the state's; whether it is FP8 already is part of what a plan's forward casts), in
    backward the output gradient."""
    if not ENABLED:
        return fn(*args)
    pack = fuser.__dict__.get("_fp8_pack")
    if pack is None:
        pack = fuser.__dict__["_fp8_pack"] = DelayedPack()
    handle = pack.begin(fuser, plan, (id(plan), r, r == 0 and is_float8(x)), r, x.device)
    try:
        out = fn(*args)
    except BaseException:
        pack.end(handle, False)
        raise
    pack.end(handle, True)
    return out


__all__ = ["DelayedPack", "run_batched"]
