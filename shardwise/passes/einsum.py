"""Fuse a linear layer's view -> mm -> view into one einsum that keeps the batch dims.

PyTorch lowers ``nn.Linear`` on a ``[*b, K]`` input to a flatten, a 2-D matmul and an unflatten,
which hides the batch and sequence dims from the planner (it only sees ``[prod(b), K]``). This
pass restores them:

Forward / input-gradient form::

    f = view(x, [prod(b), K])        # x: [*b, K]   (view, _unsafe_view or reshape)
    m = mm(f, w)                     # w: [K, N]    (often t(weight) or permute(weight, [1, 0]))
    y = view(m, [*b, N])
        ->  y = einsum("{b}k,kn->{b}n", x, w)

    m = addmm(bias, f, w); y = view(m, [*b, N])
        ->  y = add(einsum("{b}k,kn->{b}n", x, w), bias)

Weight-gradient form::

    m = mm(t(view(dy, [prod(b), N])), view(x, [prod(b), K]))      # [N, K]
        ->  m = einsum("{b}n,{b}k->nk", dy, x)

Safety conditions (each a named predicate below; anything not proven is left alone):

- every flatten is canonical: ``[*b, K] -> [prod(b), K]`` with ``rank(b) >= 1`` (input rank >= 3),
  all shapes static integers (a symbolic dim never matches);
- forward: the mm's other operand is a static ``[K, N]`` matrix; the mm's only user is the
  matching unflatten ``[prod(b), N] -> [*b, N]`` with the *same* ``b`` (same order); an ``addmm``
  has ``beta == alpha == 1`` and a 1-D ``[N]`` bias;
- weight-gradient: the transpose is exactly a 2-D transpose (``t``, ``transpose(0, 1)``,
  ``permute([1, 0])``) and both flattenings have equal batch dims;
- nodes that other users still need (a flatten read elsewhere in its flat form) are kept; only
  nodes left without users are erased.

The new node keeps the replaced node's meta (``val`` recomputed on fake tensors, same shape),
with ``seq_nr`` taken from the mm so forward/backward pairs still match.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import fx

from shardwise.ir.match import (
    arg_node,
    erase_if_dead,
    is_flatten,
    is_op,
    is_transpose_2d,
    is_unflatten,
    single_user,
)
from shardwise.ir.meta import VAL, copy_meta, fake_value, shape

aten = torch.ops.aten
log = logging.getLogger(__name__)

# Letters for the restored batch dims, in order: "bsk,kn->bsn" for the usual [batch, seq, K]
# input. A flatten of more batch dims than letters is left alone.
BATCH_LETTERS = "bsuvwxyz"
MAX_BATCH_RANK = len(BATCH_LETTERS)
# The contraction and output letters of the 2-D weight ([K, N]) and of the weight gradient.
K_LETTER, N_LETTER = "k", "n"
# addmm's scalar defaults: the pass only rewrites the plain ``bias + a @ b``.
ADDMM_UNIT_SCALE = 1


def forward_equation(batch_rank: int) -> str:
    """``"bsk,kn->bsn"`` for ``batch_rank == 2``."""
    b = BATCH_LETTERS[:batch_rank]
    return f"{b}{K_LETTER},{K_LETTER}{N_LETTER}->{b}{N_LETTER}"


def weight_grad_equation(batch_rank: int) -> str:
    """``"bsn,bsk->nk"`` for ``batch_rank == 2``."""
    b = BATCH_LETTERS[:batch_rank]
    return f"{b}{N_LETTER},{b}{K_LETTER}->{N_LETTER}{K_LETTER}"


# --------------------------------------------------------------------------------------------
# Safety conditions
# --------------------------------------------------------------------------------------------


def canonical_flatten(view: object) -> tuple[int, ...] | None:
    """The batch dims ``b`` when ``view`` is a canonical ``[*b, K] -> [prod(b), K]`` flatten we
    can name with einsum letters; else None."""
    if not isinstance(view, fx.Node):
        return None
    batch = is_flatten(view)
    if batch is None or len(batch) > MAX_BATCH_RANK:
        return None
    return batch


def is_kn_operand(w: object, k: int) -> bool:
    """``w`` is a static 2-D ``[K, N]`` matrix contracting over ``k``."""
    if not isinstance(w, fx.Node):
        return False
    s = shape(w)
    return s is not None and len(s) == 2 and s[0] == k


def only_user_is_unflatten(mm: fx.Node, batch: tuple[int, ...]) -> fx.Node | None:
    """The mm's single user when it is the unflatten back to ``[*batch, N]`` (same dims, same
    order); None when the flat product has another user that needs the flat form."""
    user = single_user(mm)
    if user is None or not is_unflatten(user, batch) or arg_node(user) is not mm:
        return None
    return user


def is_plain_addmm(node: fx.Node) -> bool:
    """``addmm(bias, a, b)`` with ``beta == alpha == 1`` and a 1-D ``[N]`` bias."""
    if node.kwargs.get("beta", ADDMM_UNIT_SCALE) != ADDMM_UNIT_SCALE:
        return False
    if node.kwargs.get("alpha", ADDMM_UNIT_SCALE) != ADDMM_UNIT_SCALE:
        return False
    bias, out = arg_node(node, 0), shape(node)
    bshape = shape(bias) if bias is not None else None
    return bshape is not None and out is not None and bshape == (out[1],)


def same_batch(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> bool:
    """Both flattenings exist and fold the same batch dims in the same order."""
    return a is not None and b is not None and a == b


def _decline(node: fx.Node, why: str) -> None:
    """Say at debug level why a candidate mm is left alone (the same way for every condition)."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("einsum: leaving %s alone: %s", node.format_node(), why)


# --------------------------------------------------------------------------------------------
# Matches
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearMatch:
    """view -> mm/addmm -> view: the forward (and input-gradient) linear layer."""

    flatten: fx.Node
    mm: fx.Node
    weight: fx.Node
    unflatten: fx.Node
    batch: tuple[int, ...]
    bias: fx.Node | None = None

    def rewrite(self, graph: fx.Graph) -> None:
        # Read the flatten's input now, not at match time: an earlier rewrite may have replaced it.
        src = arg_node(self.flatten)
        with graph.inserting_before(self.mm):
            equation = forward_equation(len(self.batch))
            ein = graph.call_function(aten.einsum.default, (equation, [src, self.weight]))
            _set_meta(ein, self.unflatten, self.mm, fresh_val=self.bias is not None)
            out = ein
            if self.bias is not None:
                out = graph.call_function(aten.add.Tensor, (ein, self.bias))
                _set_meta(out, self.unflatten, self.mm)
        self.unflatten.replace_all_uses_with(out)
        erase_if_dead([self.unflatten, self.mm, self.flatten])


@dataclass(frozen=True)
class WeightGradMatch:
    """mm(t(view(dy)), view(x)): the weight gradient of a linear layer, [N, K]."""

    mm: fx.Node
    transpose: fx.Node
    dy_flatten: fx.Node
    x_flatten: fx.Node
    batch: tuple[int, ...]

    def rewrite(self, graph: fx.Graph) -> None:
        dy, x = arg_node(self.dy_flatten), arg_node(self.x_flatten)
        with graph.inserting_before(self.mm):
            equation = weight_grad_equation(len(self.batch))
            ein = graph.call_function(aten.einsum.default, (equation, [dy, x]))
            _set_meta(ein, self.mm, self.mm)
        self.mm.replace_all_uses_with(ein)
        erase_if_dead([self.mm, self.transpose, self.dy_flatten, self.x_flatten])


Match = LinearMatch | WeightGradMatch


def match_linear(mm: fx.Node) -> LinearMatch | None:
    """Recognise the forward / input-gradient form rooted at ``mm`` (an mm or addmm)."""
    bias = None
    if is_op(mm, aten.addmm.default):
        if not is_plain_addmm(mm):
            _decline(mm, "addmm with scaling or a bias that is not [N]")
            return None
        bias, lhs, rhs = mm.args[0], mm.args[1], mm.args[2]
    elif is_op(mm, aten.mm.default):
        lhs, rhs = mm.args[0], mm.args[1]
    else:
        return None
    batch = canonical_flatten(lhs)
    if batch is None:
        _decline(mm, "left operand is not a canonical flatten of a rank >= 3 tensor")
        return None
    k = shape(lhs)[1]
    if not is_kn_operand(rhs, k):
        _decline(mm, "right operand is not a static [K, N] matrix")
        return None
    unflatten = only_user_is_unflatten(mm, batch)
    if unflatten is None:
        _decline(mm, "its only user is not the matching unflatten")
        return None
    return LinearMatch(lhs, mm, rhs, unflatten, batch, bias)


def match_weight_grad(mm: fx.Node) -> WeightGradMatch | None:
    """Recognise ``mm(t(view(dy)), view(x))`` rooted at ``mm``."""
    if not is_op(mm, aten.mm.default):
        return None
    lhs, rhs = mm.args[0], mm.args[1]
    if not isinstance(lhs, fx.Node) or not is_transpose_2d(lhs):
        _decline(mm, "left operand is not a 2-D transpose")
        return None
    dy_flat = arg_node(lhs)
    dy_batch, x_batch = canonical_flatten(dy_flat), canonical_flatten(rhs)
    if not same_batch(dy_batch, x_batch):
        _decline(mm, "the two flattenings are not canonical with equal batch dims")
        return None
    return WeightGradMatch(mm, lhs, dy_flat, rhs, dy_batch)


def find_matches(graph: fx.Graph) -> list[Match]:
    """Every rewritable mm/addmm in graph order (each mm in at most one match)."""
    found: list[Match] = []
    for node in graph.nodes:
        if not is_op(node, aten.mm.default, aten.addmm.default):
            continue
        # A transposed left operand can only be the weight-gradient form; anything else is tried
        # as the forward form (each declines with its own reason).
        lhs = node.args[1] if is_op(node, aten.addmm.default) else node.args[0]
        is_wgrad = isinstance(lhs, fx.Node) and is_transpose_2d(lhs)
        m = match_weight_grad(node) if is_wgrad else match_linear(node)
        if m is not None:
            found.append(m)
    return found


def apply(gm: fx.GraphModule) -> int:
    """Rewrite every proven view-mm-view (and weight-gradient mm) to einsum; returns the count."""
    matches = find_matches(gm.graph)
    for m in matches:
        m.rewrite(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return len(matches)


# --------------------------------------------------------------------------------------------
# Graph surgery helpers
# --------------------------------------------------------------------------------------------


def _set_meta(new: fx.Node, replaced: fx.Node, mm: fx.Node, *, fresh_val: bool = False) -> None:
    """Keep ``replaced``'s meta on ``new``, with ``seq_nr`` from the mm.

    The einsum computes exactly the replaced node's value (same shape, dtype and contiguous
    layout), so its ``val`` is kept; ``fresh_val`` gives ``new`` its own FakeTensor of that
    shape (for a second node computing the same shape, so two nodes never share one value).
    """
    copy_meta(new, replaced, seq_nr_from=mm)
    val = fake_value(replaced)
    if fresh_val and val is not None and getattr(val, "fake_mode", None) is not None:
        with val.fake_mode:
            new.meta[VAL] = torch.empty_like(val)
