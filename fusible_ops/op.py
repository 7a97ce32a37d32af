"""Operation base classes: the contracts every basic and fused op follows.

Vocabulary
----------
* A **basic op** (:class:`BasicOperation`) is one step of math (a linear, a bias add, an
  activation...). It is a ``torch.nn.Module`` and owns all parameters and state.
* A **fused op** (:class:`FusedOperation`) replaces a run of adjacent basic ops with fewer
  kernels. It holds no parameters or state of its own; it references the basic ops it
  replaces (``basic_ops``), so a checkpoint is identical with fusion on or off.
* Both expose ``fuser_forward`` / ``fuser_backward``, which the
  :class:`~fusible_ops.fuser.OperationFuser` calls. All list arguments hold one entry per
  basic op covered, in order.

What must hold (the contract)
-----------------------------
* ``ctxs[i]`` is the :class:`OperationContext` of ``basic_ops[i]``. Whatever runs a basic op's
  forward (the op itself, or a fused op) must leave in its ctx exactly what that op's own
  backward reads, so forward and backward fusions can be planned independently. A fused op
  whose forward and backward are only equivalent as a pair is registered as a ``"joint"`` rule.
* ``fuser_forward`` returns ``(y, extra_outputs)``; ``extra_outputs[i]`` is a tuple with
  ``basic_ops[i].num_extra_outputs`` tensors.
* ``fuser_backward`` returns ``(dx, param_grads, grad_extra_inputs)``; ``param_grads[i]`` is a
  tuple with one entry per parameter of ``basic_ops[i]`` in ``param_names()`` order (the order
  the op registered them; ``None`` where no gradient goes to autograd), ``grad_extra_inputs[i]``
  one entry per extra input.
* Ops read their parameters as attributes (``self.weight``), never through ``_parameters``:
  the fuser resolves the same names once per call (so ``torch.func.functional_call``,
  parametrizations and parameters lent by an owning module such as :class:`~fusible_ops.Linear`
  are honoured) and hands them to autograd.
* Plans are cached. Rule predicates and checkers may read an op's attributes: assigning any
  attribute of an op (``op.flag = True``, ``op.train()``) bumps its ``state_version``, which is
  part of the plan key; replacing a parameter by a tensor of the same shape, dtype and device,
  or FSDP2's unshard and reshard (in ``param_dtype`` too), does not (see ``_parameter_swapped``). State a rule reads that is not an attribute assignment (a value inside
  a mutable container, a global) must be reported by ``plan_key()``.
  ``dx`` may be ``None`` when ``ctxs[0].input_requires_grad`` is False.
* A weight that does not require grad costs no weight-gradient work and forward saves nothing
  that only its gradient needs (see :mod:`fusible_ops.grad`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch


class OperationContext:
    """Per-basic-op state carried from forward to backward.

    Attributes set by the fuser before ``fuser_forward`` runs:

    * ``requires_grad``: autograd will run backward through this op.
    * ``input_requires_grad``: a gradient is needed for this op's input (the fuser's input
      requires grad, or an earlier op has trainable parameters or extra inputs needing grad).
    * ``weight_requires_grad``: autograd will run backward through this op and at least one of
      its parameters requires grad.
    * ``training``: a training call: grad mode was on when the call was made and the op is in
      training mode (``op.training``, and so the module owning its parameters, e.g. the
      ``Linear`` of a ``BasicLinear``). State kept between steps (FP8 delayed-scaling histories,
      a router's expert load) changes only then; an evaluation call (``torch.no_grad()``,
      ``model.eval()``) reads it as it is. (Grad mode itself is off inside the fuser's autograd
      function: the plan, keyed on it, decides.)

    Ops may set any other attribute they need in backward.

    ``gated_weight``: on a call under PyTorch's autograd (CPU, small CUDA inputs), the alias of a weight-owning op's
    contract weight that the op must compute with (see :class:`fusible_ops.grad.ContractGate`);
    None otherwise.
    """

    gated_weight: Optional[torch.Tensor] = None

    def __init__(self, requires_grad: bool = False, input_requires_grad: bool = False,
                 weight_requires_grad: bool = False, training: bool = False) -> None:
        self.requires_grad = requires_grad
        self.input_requires_grad = input_requires_grad
        self.weight_requires_grad = weight_requires_grad
        self.training = training
        self._saved: tuple = ()

    def save_for_backward(self, *tensors: Optional[torch.Tensor]) -> None:
        """Keep tensors (or ``None``) for backward. Replaces anything saved before."""
        self._saved = tensors

    @property
    def saved_tensors(self) -> tuple:
        return self._saved

    def release(self) -> None:
        """Drop saved tensors (called by the fuser once this op's backward has run)."""
        self._saved = ()


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _is_dtensor(t: torch.Tensor) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


def _swapped(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether assigning ``new`` over the parameter ``old`` is a swap: a tensor of the same
    geometry, or FSDP2's swap between the sharded ``DTensor`` and the unsharded tensor, whose dtype
    is ``MixedPrecisionPolicy.param_dtype`` where one is set."""
    return _same_geometry(old, new) or (old.shape == new.shape and _is_dtensor(old) != _is_dtensor(new))


STATE_EPOCH = [0]
"""Bumped with every op's ``state_version``: a fuser re-reads its ops' versions only when it moved."""

_fuser_factory: Optional[Callable[[list], Any]] = None


def set_fuser_factory(factory: Callable[[list], Any]) -> None:
    """Make ``factory(basic_ops)`` build the fuser that runs a module called directly
    (:meth:`FusibleOperation.own_fuser`). :mod:`fusible_ops.fuser` registers
    :class:`~fusible_ops.fuser.OperationFuser` when it is imported (``import fusible_ops`` imports
    it), so this module, the contracts, imports nothing above it."""
    global _fuser_factory
    _fuser_factory = factory


class FusibleOperation(torch.nn.Module):
    """Common interface of basic and fused ops."""

    state_version: int = 0  # bumped by every attribute assignment (part of the plan key)

    cpu_autograd: bool = False
    """True when, on the reference path (CPU; CUDA in ``kernels.use("reference")``), this op's
    ``fuser_forward`` is plain differentiable PyTorch whose autograd
    gradients (of the input, extra inputs and parameters) are what its backward computes, and
    its outputs do not depend on the ctx flags. A CPU training call whose forward steps are all
    such ops then runs under PyTorch's own autograd (:data:`fusible_ops.fuser.CPU_AUTOGRAD`; also a
    small CUDA call, :data:`fusible_ops.fuser.NATIVE_MAX_NUMEL`): no
    autograd function, no ``fuser_backward``. A :class:`~fusible_ops.grad.WeightGradMixin` op that
    sets it computes with ``ctx.gated_weight`` when that is set (its trainable ``weight`` may go
    through :class:`~fusible_ops.grad.ContractGate`, which keeps the gradient contract)."""

    replayable: bool = False
    """True when, on CUDA, this op's forward and backward (``fuser_forward`` / ``fuser_backward``, or
    ``op_forward`` / ``op_backward``) issue only cached Triton launches (``DirectKernel``),
    allocations, views and ATen ops whose results depend on their inputs alone (cuBLAS GEMMs, adds,
    casts: no host read, no random draw), every launch argument a function of the inputs' sizes,
    strides, dtypes, device and this op's attributes, and return their gradients to autograd as
    they are. A training plan whose steps all set it is replayed from C++
    (:mod:`fusible_ops.replay`; the recording checks each of these and keeps a call that breaks
    one on the Python path)."""

    def __init__(self) -> None:
        # (torch.nn.Module's own signature is ``(*args, **kwargs)``: ops without parameters of
        # their own inherit this one, so ``help(fo.SwiGLU)`` shows ``SwiGLU()``)
        super().__init__()

    def __setattr__(self, name: str, value: Any) -> None:
        params = self.__dict__.get("_parameters")
        old = params.get(name) if params is not None else None
        super().__setattr__(name, value)
        if old is not None and isinstance(value, torch.Tensor) and _swapped(old, value):
            self._parameter_swapped(name, old, value)  # (no replan: the fuser reads parameters per call)
            if self._call_dtype_moved(name, old, value):
                self._bump_state_version()
        else:
            self._bump_state_version()

    def _call_dtype_moved(self, name: str, old: torch.Tensor, new: torch.Tensor) -> bool:
        """Whether the dtype calls see of parameter ``name`` changed: FSDP2's first unshard in a
        ``param_dtype`` other than the weights' (a rule may read the dtype); the unshards after it
        gather that dtype again and the reshards put back a ``DTensor`` no call sees."""
        seen = self.__dict__.setdefault("_call_dtypes", {})
        if _is_dtensor(new):
            seen.setdefault(name, old.dtype)
            return False
        before, seen[name] = seen.get(name, old.dtype), new.dtype
        return before != new.dtype

    def _parameter_swapped(self, name: str, old: torch.Tensor, new: torch.Tensor) -> None:
        """A parameter was replaced by another tensor of the same shape, dtype and device, e.g. by
        FSDP2 (``fully_shard``), which swaps every parameter between its sharded ``DTensor`` and the
        unsharded tensor at each unshard and reshard. Plans do not depend on which tensor it is
        (the fuser reads the parameters at every call), so the op's ``state_version`` stays; ops
        that keep something derived from a parameter drop it here (the FP8 weight cache)."""

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        self._bump_state_version()

    def _bump_state_version(self) -> None:
        d = self.__dict__
        d["state_version"] = d.get("state_version", 0) + 1
        STATE_EPOCH[0] += 1
        for op in d.get("_borrowers", ()):  # ops that read parameters owned by this module
            op._bump_state_version()

    @property
    def is_fused_op(self) -> bool:
        raise NotImplementedError

    @property
    def basic_ops(self) -> tuple["BasicOperation", ...]:
        raise NotImplementedError

    def fuser_forward(
        self,
        ctxs: list[OperationContext],
        x: torch.Tensor,
        *,
        extra_inputs: list[tuple[torch.Tensor, ...]],
        **kwargs: Any,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """Forward over the covered basic ops. See the module docstring for what must hold.

        ``kwargs`` holds ``basic_op_kwargs``: a list with one dict per basic op of keyword
        arguments for its ``op_forward`` (quantizer hand-off; all entries have defaults).
        """
        raise NotImplementedError

    def fuser_backward(
        self,
        ctxs: list[OperationContext],
        dy: torch.Tensor,
        *,
        grad_extra_outputs: list[tuple[Optional[torch.Tensor], ...]],
        **kwargs: Any,
    ) -> tuple[Optional[torch.Tensor], list[tuple], list[tuple]]:
        """Backward over the covered basic ops. See the module docstring for what must hold."""
        raise NotImplementedError

    def own_fuser(self):
        """The fuser that runs this module's basic ops when it is called directly."""
        fuser = self.__dict__.get("_self_fuser")
        if fuser is None:
            if _fuser_factory is None:
                raise RuntimeError(f"{type(self).__name__}: no fuser is registered to run it (fusible_ops.fuser "
                                   f"registers OperationFuser when imported: import fusible_ops)")
            fuser = _fuser_factory(list(self.basic_ops))
            self.__dict__["_self_fuser"] = fuser
        return fuser

    def forward(self, x: torch.Tensor, *extra_inputs: torch.Tensor):
        """Run the covered basic ops as one fuser (planned with the global rules)."""
        return self.own_fuser()(x, *extra_inputs)


class BasicOperation(FusibleOperation):
    """A single step of math that owns its parameters and state.

    Simple ops implement ``op_forward(ctx, x, **kwargs) -> y`` and
    ``op_backward(ctx, dy) -> (dx, param_grads)``. Ops with extra inputs or outputs set
    ``num_extra_inputs`` / ``num_extra_outputs`` (and ``extra_input_names``) and override
    ``fuser_forward`` / ``fuser_backward`` instead.

    Ops may also define ``reference_forward(x, *extra_inputs)`` in plain differentiable
    PyTorch: the test helpers use it to check the op's math independently of its kernels.

    Calling the op directly (``op(x, *extra_inputs)``) runs it as a one-op fuser.

    Pieces protocol (how a fused op reuses a basic op, instead of reaching into private
    methods): every basic op with inputs to validate defines ``check_input(x)``, which raises the
    error the op itself would raise for a bad input; an op whose ctx a fused op may fill defines
    ``save_ctx(ctx, ...)``, which stores exactly what the op's backward reads. Flags in a ctx
    that say whether a parameter's gradient is computed are named ``ctx.weight_grad`` and
    ``ctx.bias_grad`` (``ctx.scales_grad`` for a gradient of an extra input), on every op.
    """

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0
    is_loss: bool = False
    """True for a loss (:class:`~fusible_ops.CrossEntropy`): its output is the loss, not an input any
    op takes, so it must be the last op of its :class:`~fusible_ops.Sequential` (or fuser);
    anything after it raises :func:`loss_not_last`'s error when the chain is built."""
    extra_input_names: tuple[str, ...] = ()
    """The names of the extra inputs, in order, by which a :class:`~fusible_ops.Sequential` accepts
    them as keywords (``seq(x, residual=r)``; e.g. ``AddExtraInput``: ``("residual",)``). Empty
    (the default): ``("extra_input",)`` for one extra input, ``("extra_input_0", "extra_input_1",
    ...)`` for several."""

    @property
    def is_fused_op(self) -> bool:
        return False

    @property
    def basic_ops(self) -> tuple["BasicOperation", ...]:
        return (self,)

    # -- quantization hand-off (FP8 lands in a later issue: None until then) ---------
    def input_quantizer(self) -> Any:
        """Quantizer this op wants its input in (``None``: plain tensors)."""
        return None

    def grad_output_quantizer(self) -> Any:
        """Quantizer this op wants its output's gradient in (``None``: plain tensors)."""
        return None

    # -- parameters ----------------------------------------------------------------------
    def register_parameter(self, name: str, param) -> None:
        super().register_parameter(name, param)
        order = self.__dict__.setdefault("_param_order", [])
        if name not in order:
            order.append(name)

    def __getattr__(self, name: str):
        d = self.__dict__
        params = d.get("_parameters")
        if params is not None and name in params:  # (torch's own first lookup, without its frame)
            return params[name]
        lent = d.get("_lent_params")
        if lent is not None and name in lent[1]:
            owner = lent[0]()
            # The owner's registered parameter (also what ``functional_call`` swaps in) when it
            # has one; else whatever its attribute is (a parametrization's property, a tensor).
            params = owner.__dict__["_parameters"]
            if name in params and name not in owner.__dict__:
                return params[name]
            return getattr(owner, name)
        return super().__getattr__(name)

    def lend_parameters(self, owner: torch.nn.Module, names: tuple[str, ...]) -> None:
        """Let ``owner`` own this op's parameters ``names``: they are removed from this op and
        ``self.<name>`` reads ``owner.<name>`` from then on (so whatever torch does to the owner's
        attribute, e.g. ``functional_call`` or a parametrization, is what this op computes with).
        The owner registers them itself. Used by composite modules such as ``Linear``.

        The owner is held by a weak reference: it holds this op (a child module, and in
        ``_borrowers``), so a strong one back would be a cycle that keeps the parameters alive after
        ``del model`` until the cyclic GC runs. Copies and pickles hold it strongly in between
        (``__getstate__`` / ``__setstate__``), so a copy's ops read the copy's owner."""
        for n in names:
            self._parameters.pop(n, None)
        self.__dict__["_lent_params"] = (weakref.ref(owner), frozenset(names))
        owner.__dict__.setdefault("_borrowers", []).append(self)
        self._bump_state_version()

    def param_names(self) -> tuple[str, ...]:
        """Names of the parameters this op computes with, in registration order (``None``
        entries skipped). ``getattr(self, name)`` gives the tensor to use for this call."""
        cache = self.__dict__.get("_param_names_cache")
        version = self.__dict__.get("state_version", 0)
        if cache is None or cache[0] != version:
            names = tuple(n for n in self.__dict__.get("_param_order", ()) if _has_tensor(self, n))
            cache = (version, names)
            self.__dict__["_param_names_cache"] = cache
        return cache[1]

    def param_owner(self, name: str) -> torch.nn.Module:
        """The module whose attribute ``name`` is this op's parameter (self, or the owner)."""
        lent = self.__dict__.get("_lent_params")
        return lent[0]() if lent is not None and name in lent[1] else self

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        lent = state.get("_lent_params")
        if lent is not None:  # (a weak reference neither pickles nor deep-copies to the copy's owner)
            state["_lent_params"] = (lent[0](), lent[1])
        return state

    def __setstate__(self, state: dict) -> None:
        lent = state.get("_lent_params")
        if lent is not None and not isinstance(lent[0], weakref.ref):
            state = dict(state, _lent_params=(weakref.ref(lent[0]), lent[1]))
        super().__setstate__(state)

    # -- planning hooks ----------------------------------------------------------------
    def plan_key(self) -> tuple:
        """Op state a fusion rule may depend on that is NOT an attribute assignment (those are
        covered by ``state_version``), e.g. a value inside a mutable container.

        Included in the plan cache key; keep it cheap (a tuple of scalars).
        """
        return ()

    # -- simple-op interface -----------------------------------------------------------
    def op_forward(self, ctx: OperationContext, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement op_forward or fuser_forward")

    def op_backward(self, ctx: OperationContext, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], tuple]:
        raise NotImplementedError(f"{type(self).__name__} must implement op_backward or fuser_backward")

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        if self.num_extra_inputs or self.num_extra_outputs:
            raise NotImplementedError(f"{type(self).__name__} has extra inputs/outputs: override fuser_forward")
        op_kwargs = _op_kwargs(kwargs)
        return self.op_forward(ctxs[0], x, **op_kwargs), [()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        dx, param_grads = self.op_backward(ctxs[0], dy)
        return dx, [tuple(param_grads)], [()]

    def extra_repr(self) -> str:
        return ""


def loss_not_last(loss: BasicOperation, follower: str, where: str = "") -> ValueError:
    """The error for a loss (:attr:`BasicOperation.is_loss`) that ``follower`` (the module or op
    after it, described) follows; ``where``: where the loss is, when that is not plain."""
    return ValueError(f"{type(loss).__name__}: a loss must be the last op of a Sequential, but {follower} follows "
                      f"it{where}; use the loss outside the Sequential")


def check_loss_last(ops) -> None:
    """Raise :func:`loss_not_last`'s error if a loss among basic ``ops`` (a fuser's) is not the last."""
    for i, op in enumerate(ops[:-1]):
        if op.is_loss:
            raise loss_not_last(op, f"op [{i + 1}] {type(ops[i + 1]).__name__}")


def _has_tensor(op: torch.nn.Module, name: str) -> bool:
    try:
        return getattr(op, name) is not None
    except AttributeError:
        return False


def _op_kwargs(kwargs: dict) -> dict:
    """The per-op keyword arguments for a basic op's ``op_forward`` (non-None entries only)."""
    per_op = kwargs.get("basic_op_kwargs")
    if not per_op:
        return {}
    return {k: v for k, v in per_op[0].items() if v is not None}


class FusedOperation(FusibleOperation):
    """An op that replaces a run of basic ops. Holds no parameters or state of its own.

    The basic ops are kept in a plain tuple (not as submodules), so fused ops never add
    parameters or state-dict entries.
    """

    # Whether this op reads a Float8Tensor input / output gradient as is (see :func:`reads_fp8`);
    # None: as the basic op it starts with (forward) or ends with (backward) does.
    accepts_fp8: Optional[bool] = None

    def __init__(self, basic_ops) -> None:
        super().__init__()
        ops = tuple(basic_ops)
        if not ops or not all(isinstance(op, BasicOperation) for op in ops):
            raise TypeError("FusedOperation needs a non-empty sequence of BasicOperation")
        self.__dict__["_basic_ops"] = ops

    def _bump_state_version(self) -> None:
        """A fused op's own attributes (set by its builder while a plan is made) are no input of
        any plan: nothing to invalidate. (Bumping ``STATE_EPOCH`` here made a ``torch.compile``
        trace that builds a plan guard on a counter its own build changed: one more trace.)"""

    @property
    def is_fused_op(self) -> bool:
        return True

    @property
    def basic_ops(self) -> tuple[BasicOperation, ...]:
        return self.__dict__["_basic_ops"]

    def __repr__(self) -> str:
        inner = ", ".join(type(op).__name__ for op in self.basic_ops)
        return f"{type(self).__name__}({inner})"


def reads_fp8(step_op: FusibleOperation, basic_op: BasicOperation) -> bool:
    """Whether a fuser step running ``step_op`` reads a Float8Tensor as is (else the fuser
    dequantizes it first, and a producer before it is not asked to write FP8): a fused op's own
    ``accepts_fp8`` where it sets one, else ``basic_op``'s (the basic op the step starts with in
    forward, ends with in backward)."""
    own = step_op.accepts_fp8 if isinstance(step_op, FusedOperation) else None
    return bool(getattr(basic_op, "accepts_fp8", False) if own is None else own)
