"""The causal-LM head of a Hugging Face ``*ForCausalLM`` model: with labels, the loss runs as
``fo.Linear(d, V, bias=False) -> fo.CrossEntropy`` (rule ``linear_cross_entropy``), so the
``[tokens, vocab]`` logits are never made; without labels the head returns logits as before.

How it plugs in without rewriting the model's forward (which stays the model's own code):

* the output embedding (``model.lm_head``) becomes a :class:`ConvertedLMHead` holding the same
  ``weight`` Parameter (a weight tied to the input embedding stays tied);
* ``model.forward`` becomes a :class:`FusedLossForward`: when labels are passed and the model is in
  training mode (or ``skip_logits=True`` is passed; ``skip_logits=False`` turns it off), the head
  returns a :class:`DeferredLogits` holding its input instead of logits, and
* ``model.loss_function`` becomes a :class:`FusedCausalLMLoss`, which computes the loss from that
  input exactly as transformers' ``ForCausalLMLoss`` does from logits (labels shifted left with
  ``ignore_index`` appended, or ``shift_labels``; mean over the non-ignored tokens, or the sum
  divided by ``num_items_in_batch``), and calls the original loss for real logits.

The output's ``logits`` is then None (as Liger-Kernel's fused forward returns). In evaluation mode
with labels the model makes the logits and the original loss, unchanged. The conversion probes the
whole thing once (:func:`install`): a model whose forward does anything with the logits between
the head and the loss (soft-capping, scaling) touches the :class:`DeferredLogits`, which raises,
and the head is left alone with that reason.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from ..ops.linear import BasicLinear
from ..ops.loss import CrossEntropy
from ..quantization.casting import weight_swapped
from ..quantization.recipes import autocast
from ..sequential import Sequential
from ..testing.tolerances import TOLERANCES


class LogitsUsed(RuntimeError):
    """The model's forward used the logits between its head and its loss (see :class:`DeferredLogits`)."""


class DeferredLogits:
    """Stands for the logits while the loss is fused: holds the head's input. Any use other than
    handing it to the model's loss raises :class:`LogitsUsed`, naming the use."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden

    @staticmethod
    def _used(what: str):
        return LogitsUsed(f"the model's forward applies {what} to the logits before its loss (the fused loss "
                          f"never makes them)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise cls._used(getattr(func, "__name__", str(func)))

    def __getattr__(self, name: str):  # (only for attributes it does not have)
        if name.startswith("__"):  # (protocol lookups, e.g. by copy or torch.compile: the usual answer)
            raise AttributeError(name)
        raise self._used(f".{name}")


def _refuse(op: str):
    def method(self, *args):
        raise self._used(op)
    return method


for _name, _op in (("add", "+"), ("sub", "-"), ("mul", "*"), ("truediv", "/"), ("floordiv", "//"), ("pow", "**"),
                   ("matmul", "@"), ("mod", "%")):
    setattr(DeferredLogits, f"__{_name}__", _refuse(_op))
    setattr(DeferredLogits, f"__r{_name}__", _refuse(_op))
for _name in ("__neg__", "__getitem__", "__iter__", "__len__"):
    setattr(DeferredLogits, _name, _refuse(_name))


class ConvertedLMHead(torch.nn.Linear):
    """A ``torch.nn.Linear`` (no bias) in place of the output embedding: the same ``weight``
    Parameter, logits through a ``fo.Sequential(BasicLinear)``, and the fused loss
    (:meth:`loss`) through ``fo.Sequential(BasicLinear, CrossEntropy)``. ``recipe``: an FP8 recipe
    both run under, or None."""

    def __init__(self, weight: torch.nn.Parameter, *, source: str = "", recipe=None) -> None:
        torch.nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", None)
        self.source = source
        self.recipe = recipe
        self.deferring = False
        self.__dict__["_seqs"] = {}

    def __setattr__(self, name: str, value) -> None:
        old = self.__dict__.get("_parameters", {}).get(name)
        super().__setattr__(name, value)
        if old is not None and isinstance(value, torch.Tensor):
            self._parameter_swapped(name, old, value)

    def _parameter_swapped(self, name: str, old: torch.Tensor, new: torch.Tensor) -> None:
        """The weight was replaced (FSDP2 swaps it at every unshard and reshard, through this
        ``__setattr__``): its cached FP8 form goes (see ``FP8StateMixin._parameter_swapped``)."""
        weight_swapped(self, old, new)

    def _seq(self, key) -> Sequential:
        seq = self._seqs.get(key)
        if seq is None:  # (not child modules: they hold no parameters, the weight is lent by this head)
            lin = BasicLinear(self.in_features, self.out_features, device="meta", dtype=self.weight.dtype)
            lin.lend_parameters(self, ("weight",))
            seq = Sequential(lin) if key == "logits" else Sequential(lin, CrossEntropy(ignore_index=key[0],
                                                                                      reduction=key[1]))
            self._seqs[key] = seq
        return seq

    def _run(self, seq, *args):
        if self.recipe is None:
            return seq(*args)
        with autocast(recipe=self.recipe):
            return seq(*args)

    def forward(self, hidden: torch.Tensor):
        if self.deferring:
            return DeferredLogits(hidden)
        return self._run(self._seq("logits"), hidden)

    def fusion_plan(self, pass_: str = "forward", ignore_index: int = -100, reduction: str = "mean") -> list:
        """The plan of the fused loss (``Sequential.fusion_plan`` of its ``Sequential``)."""
        return self._seq((ignore_index, reduction)).fusion_plan(pass_)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch=None,
             ignore_index: int = -100, shift_labels: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        """transformers' ``ForCausalLMLoss`` of ``hidden @ weight.T``, without the logits."""
        if vocab_size != self.out_features:
            raise ValueError(f"ConvertedLMHead: vocab_size {vocab_size} does not match the head's "
                             f"{self.out_features} outputs")
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift_labels.to(hidden.device).reshape(hidden.shape[:-1])
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = self._run(self._seq((int(ignore_index), reduction)), hidden, targets)
        if reduction == "sum":
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


class FusedCausalLMLoss:
    """``model.loss_function`` of a converted model: the head's fused loss for
    :class:`DeferredLogits`, the original loss function for real logits."""

    def __init__(self, head: ConvertedLMHead, original) -> None:
        self.head = head
        self.original = original

    def __call__(self, logits, labels, vocab_size, **kwargs):
        if isinstance(logits, DeferredLogits):
            return self.head.loss(logits.hidden, labels, vocab_size, **kwargs)
        return self.original(logits, labels, vocab_size, **kwargs)


class FusedLossForward:
    """``model.forward`` of a converted model: the class's own forward, with the head deferring its
    logits to the fused loss when labels are given and the model is training (``skip_logits``
    overrides that); the output's ``logits`` is then None. Keeps the signature of the class's
    forward (plus ``skip_logits``) for ``inspect`` (``generate()`` reads it)."""

    def __init__(self, model: torch.nn.Module, head: ConvertedLMHead) -> None:
        # (the model holds this object as its forward: a strong reference back would be a cycle that keeps the
        # parameters alive after ``del model`` until the cyclic GC runs; copies and pickles hold it strongly in
        # between, so a copy's forward runs the copy, as fusible ops' lent parameters do)
        self._model = weakref.ref(model)
        self.head = head
        sig = inspect.signature(type(model).forward)
        params = list(sig.parameters.values())[1:]  # (without self)
        names = [p.name for p in params]
        self.labels_pos = names.index("labels") if "labels" in names else None
        extra = inspect.Parameter("skip_logits", inspect.Parameter.KEYWORD_ONLY, default=None)
        if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD:
            params.insert(len(params) - 1, extra)
        else:
            params.append(extra)
        self.__signature__ = sig.replace(parameters=params)

    @property
    def model(self) -> torch.nn.Module:
        return self._model()

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _model=self._model())

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _model=weakref.ref(state["_model"]))

    def __call__(self, *args, skip_logits: Optional[bool] = None, **kwargs):
        model = self._model()
        pos = self.labels_pos
        labels = args[pos] if pos is not None and len(args) > pos else kwargs.get("labels")
        fuse = labels is not None and (model.training if skip_logits is None else skip_logits)
        if not fuse:
            return type(model).forward(model, *args, **kwargs)
        self.head.deferring = True
        try:
            out = type(model).forward(model, *args, **kwargs)
        finally:
            self.head.deferring = False
        if isinstance(out, tuple):
            return type(out)(None if isinstance(v, DeferredLogits) else v for v in out)
        return type(out)(**{k: v for k, v in out.items() if not isinstance(v, DeferredLogits)})


def _for_causal_lm_loss():
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except Exception:  # (transformers is optional)
        return None
    return ForCausalLMLoss


def candidate(model: torch.nn.Module) -> Optional[tuple]:
    """``(name, head module)`` when ``model`` has the shape of a Hugging Face causal LM (an output
    embedding, a ``loss_function``, a forward taking ``labels``), else None."""
    get = getattr(model, "get_output_embeddings", None)
    if not callable(get) or not hasattr(type(model), "loss_function"):
        return None
    try:
        head = get()
        params = inspect.signature(type(model).forward).parameters
    except Exception:
        return None
    if head is None or "labels" not in params:
        return None
    name = next((n for n, m in model.named_modules() if m is head), None)
    return None if name is None else (name, head)


def install(model: torch.nn.Module, name: str, old: torch.nn.Module, weight, source: str) -> Optional[str]:
    """Put the fused head in place of ``old`` (``model.<name>``), then probe: the model's loss on
    8 random tokens (no grad, the same random seed) with logits and with the fused loss must agree
    within the tolerance of the weight's dtype. Returns None, or the reason it was undone."""
    ref_loss = _for_causal_lm_loss()
    original = model.loss_function
    if ref_loss is None or original is not ref_loss:
        return "its loss_function is not transformers' ForCausalLMLoss (the loss the fused head reproduces)"
    if weight.device.type == "meta":
        return "its parameters are on the meta device: the head cannot be probed"
    head = ConvertedLMHead(weight, source=source)
    head.train(old.training)
    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    had_loss = "_loss_function" in model.__dict__
    setattr(owner, attr, head)
    model.loss_function = FusedCausalLMLoss(head, original)
    model.forward = FusedLossForward(model, head)
    reason = _probe(model, head, weight)
    if reason is not None:  # undo
        setattr(owner, attr, old)
        del model.forward
        if had_loss:
            model.loss_function = original
        else:
            del model._loss_function
    return reason


def _probe(model, head: ConvertedLMHead, weight) -> Optional[str]:
    g = torch.Generator(device="cpu")
    g.manual_seed(5)
    ids = torch.randint(0, head.out_features, (1, 8), generator=g).to(weight.device)
    outs = []
    try:  # (in the model's own mode: a train()/eval() switch bumps the ops' state versions, and a fuser that
        # sees them change inside a torch.compile trace re-plans there, which costs the compiled model a recompile;
        # the same seed for both calls, so any dropout draws the same masks)
        devices = [weight.device] if weight.device.type == "cuda" else []
        for skip in (False, True):
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                torch.manual_seed(5)
                outs.append(model(input_ids=ids, labels=ids, skip_logits=skip))
    except LogitsUsed as e:
        return str(e)
    except Exception as e:
        return f"the probe with labels raised {type(e).__name__}: {e}"
    ref, got = outs
    ref_l, got_l = _first(ref), _first(got)
    if not (torch.is_tensor(ref_l) and torch.is_tensor(got_l)):
        return "the probe with labels returned no loss"
    rtol, atol = TOLERANCES[weight.dtype if weight.dtype in TOLERANCES else torch.float32]
    if not torch.allclose(got_l.double(), ref_l.double(), rtol=rtol, atol=atol):
        return f"the fused loss {got_l.item():.6g} differs from the model's {ref_l.item():.6g} on the probe"
    return None


def _first(out):
    return out[0] if isinstance(out, tuple) else getattr(out, "loss", None)


__all__ = ["ConvertedLMHead", "DeferredLogits", "LogitsUsed", "FusedCausalLMLoss", "FusedLossForward", "candidate", "install"]
