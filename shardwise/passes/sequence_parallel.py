"""Sequence parallelism around RMSNorm: all_reduce -> norm becomes reduce_scatter -> norm -> all_gather.

A tensor-parallel block all-reduces its row-parallel output and every rank then normalises the
whole activation. The norm is per token, so each rank can normalise only its slice of the
sequence: a reduce_scatter moves the same bytes as half an all_reduce, the all_gather after the
norm the other half, and the norm (plus the residual add) runs on 1/n of the tokens. Three
ordered rules, on canonical norms (``passes/norms.py``)::

    P1  v -> all_reduce -> [reshapes, markers] -> rms_norm -> users
        =>  v -> reduce_scatter -> rms_norm -> all_gather -> users

    P2  add_rms_norm2(all_reduce(v) [reshapes], r)       with r proven sequence-local
        =>  add_rms_norm2(reduce_scatter(v), r_local) -> (all_gather(normed), sum_local)
        the sum stays local for the next P2/P3 that reads it, and is gathered for other readers

    P3  add(all_reduce(v) [reshapes], r) -> [reshapes, markers] -> rms_norm,  or
        add_rms_norm(all_reduce(v), r)                    with r proven sequence-local
        =>  add(reduce_scatter(v), r_local) -> rms_norm -> all_gather

P1 runs first, then P2, then P3 (P3 reads residuals that P2 leaves local). The sequence dim is 1
of ``[B, S, H]`` and 0 of ``[S, H]`` / ``[B*S, H]``; a scatter or gather along dim 1 has the
split/cat form ``torch.distributed._functional_collectives`` produces, except for ``B = 1`` where
it runs on dim 0 of an ``[S, H]`` view (no copy). A ``[1, S, H]`` and an
``[S, H]`` value split the same way, and a reshape repairs the shape where a graph dropped the
size-1 batch dim.

Safety conditions (named predicates below; a refused match says why at debug level):
- the all_reduce sums over a group of more than one rank that this process can resolve;
- the sequence dim divides by the group size;
- a residual is used locally only when it is proven sequence-local: it is a value this pass
  gathered from a slice it made (never a graph input, a fully gathered tensor or a bias that
  broadcasts), cut along the same group and token layout as the all_reduce ("mixed
  shardability" otherwise);
- a fused norm has exactly one all_reduce operand;
- a reduced value read in full elsewhere is only rewritten when those readers are residual inputs
  of later fused norms (their gather then dies), so no rewrite adds an all_gather on its own.
"""

from __future__ import annotations

import enum
import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

import shardwise.ir.ops  # noqa: F401  (registers torch.ops.shardwise.*)
from shardwise.ir.match import (
    Collective,
    CollectiveKind,
    arg_node,
    collective,
    insert_call_after,
    is_op,
    is_reshape_or_marker,
    seq_dim,
    seq_local_shape,
    source_through_reshapes,
    token_layout,
)
from shardwise.ir.meta import shape

log = logging.getLogger(__name__)
aten = torch.ops.aten
c10d = torch.ops._c10d_functional
RMS_NORM = torch.ops.shardwise.rms_norm.default
ADD_RMS_NORM = torch.ops.shardwise.add_rms_norm.default
ADD_RMS_NORM2 = torch.ops.shardwise.add_rms_norm2.default
FUSED_NORMS = (ADD_RMS_NORM, ADD_RMS_NORM2)
SUM = "sum"


class Rule(enum.Enum):
    P1 = "all_reduce -> norm"
    P2 = "all_reduce -> add_rms_norm2"
    P3 = "local residual + all_reduce -> add -> norm"


class Refusal(enum.Enum):
    NOT_SUM = "the all_reduce does not sum"
    SINGLE_RANK = "the all_reduce's group has one rank (or cannot be resolved here)"
    NOT_DIVISIBLE = "the sequence dim does not divide by the group size"
    NO_SEQ_DIM = "the activation is neither [B, S, H] nor [S, H]"
    TWO_ALL_REDUCES = "both operands are all_reduces"
    BIAS_SHAPED = "the residual broadcasts (bias-shaped)"
    GATHERED_RESIDUAL = "the residual is a fully gathered tensor"
    NOT_LOCAL = "the residual is not proven sequence-local"
    MIXED = "the residual is split along another group or token layout (mixed shardability)"
    READ_IN_FULL = "the reduced value is also read in full elsewhere"


@dataclass(frozen=True)
class Local:
    """This rank's slice ``node`` of a full value of ``full_shape`` split along its sequence dim
    over ``parts`` ranks of ``group_name``."""

    node: fx.Node
    full_shape: tuple[int, ...]
    group_name: str
    parts: int


@dataclass
class Reduced:
    """An all_reduce as seen from one consumer operand ``arg`` (a reshape/marker chain of its wait)."""

    coll: Collective
    arg: fx.Node


@dataclass
class Match:
    rule: Rule
    norm: fx.Node
    reduced: Reduced
    residual: Local | None = None
    residual_first: bool = False  # the residual is the consumer's first operand
    residual_arg: fx.Node | None = None
    add: fx.Node | None = None  # P3 with an unfused add


@dataclass
class _State:
    """Full values this pass produced by gathering a slice it holds (value -> its slice)."""

    locals: dict[fx.Node, Local] = field(default_factory=dict)
    touched: list[fx.Node] = field(default_factory=list)


# --- operands --------------------------------------------------------------------------------

def reduced_operand(arg: object) -> Reduced | None:
    """``arg`` is (a reshape/marker chain of) the value of an all_reduce."""
    if not isinstance(arg, fx.Node):
        return None
    src, _ = source_through_reshapes(arg, single_user=False)
    c = collective(src)
    if c is None or c.kind is not CollectiveKind.ALL_REDUCE or c.value is not src:
        return None
    return Reduced(c, arg)


def local_of(arg: object, state: _State) -> Local | None:
    """The slice behind ``arg`` when ``arg`` is (a reshape/marker chain of) a value this pass gathered."""
    cur = arg
    while isinstance(cur, fx.Node):
        if cur in state.locals:
            return state.locals[cur]
        if not is_reshape_or_marker(cur):
            return None
        cur = arg_node(cur)
    return None


def _is_gathered(arg: fx.Node) -> bool:
    src, _ = source_through_reshapes(arg, single_user=False)
    while is_op(src, aten.cat.default) or is_op(src, operator.getitem) or is_op(src, aten.split.Tensor):
        src = arg_node(src) if not is_op(src, aten.cat.default) else arg_node(src.args[0][0])
        if src is None:
            return False
    c = collective(src) if src is not None else None
    return c is not None and c.kind is CollectiveKind.ALL_GATHER


# --- safety predicates -----------------------------------------------------------------------

def reduces_by_sum(c: Collective) -> bool:
    """The all_reduce sums (the only reduction a reduce_scatter + norm reproduces here)."""
    return c.reduce_op == SUM and c.wait is not None


def group_is_parallel(c: Collective) -> bool:
    """The group has more than one rank and its size is known in this process."""
    return c.group_size is not None and c.group_size > 1


def sequence_divides(full_shape: tuple[int, ...] | None, parts: int) -> bool:
    """The activation has a sequence dim that splits evenly over ``parts`` ranks."""
    return full_shape is not None and seq_local_shape(full_shape, parts) is not None


def same_sharding(local: Local, c: Collective, full_shape: tuple[int, ...]) -> bool:
    """A residual slice lines up token for token with the slice the all_reduce will scatter."""
    return (local.group_name == c.group_name and local.parts == c.group_size
            and token_layout(local.full_shape) == token_layout(full_shape))


def other_readers_take_local(red: Reduced, consumer: fx.Node) -> bool:
    """Every reader of the reduced value other than ``consumer``'s operand chain is (through
    reshapes) a fused norm, or an add into a norm, whose other operand is an all_reduce: later
    rules will read the slice, so the gather this rewrite gives them dies."""
    wait = red.coll.value
    chain = {red.arg, *source_through_reshapes(red.arg, single_user=False)[1]}
    stack = [(u, n) for n in [wait, *chain] for u in n.users if u is not consumer and u not in chain]
    while stack:
        u, n = stack.pop()
        if is_reshape_or_marker(u):
            stack += [(uu, u) for uu in u.users]
            continue
        if is_op(u, *FUSED_NORMS) or (is_op(u, aten.add.Tensor) and len(u.users) == 1):
            others = [a for a in u.args[:2] if isinstance(a, fx.Node) and a is not n]
            if len(others) == 1 and reduced_operand(others[0]) is not None:
                continue
        return False
    return True


def _check_reduced(red: Reduced, full_shape: tuple[int, ...] | None) -> Refusal | None:
    c = red.coll
    if not reduces_by_sum(c):
        return Refusal.NOT_SUM
    if not group_is_parallel(c):
        return Refusal.SINGLE_RANK
    if seq_dim(full_shape) is None:
        return Refusal.NO_SEQ_DIM
    if not sequence_divides(full_shape, c.group_size):
        return Refusal.NOT_DIVISIBLE
    return None


def _refuse(rule: Rule, node: fx.Node, why: Refusal) -> None:
    log.debug("sequence_parallel %s: leave %s: %s", rule.name, node.format_node(), why.value)


# --- finders ---------------------------------------------------------------------------------

def match_p1(norm: fx.Node) -> Match | None:
    if not is_op(norm, RMS_NORM):
        return None
    red = reduced_operand(norm.args[0])
    if red is None:
        return None
    why = _check_reduced(red, shape(red.arg))
    if why is None and not other_readers_take_local(red, norm):
        why = Refusal.READ_IN_FULL
    if why is not None:
        return _refuse(Rule.P1, norm, why)
    return Match(Rule.P1, norm, red)


def _match_pair(rule: Rule, consumer: fx.Node, a: object, b: object, state: _State) -> Match | None:
    """One reduced operand and one sequence-local residual among ``a``, ``b``."""
    ra, rb = reduced_operand(a), reduced_operand(b)
    la, lb = local_of(a, state), local_of(b, state)
    if ra is not None and rb is not None and la is None and lb is None:
        return _refuse(rule, consumer, Refusal.TWO_ALL_REDUCES)
    if ra is not None and la is None:
        red, res_arg, residual_first = ra, b, False
    elif rb is not None and lb is None:
        red, res_arg, residual_first = rb, a, True
    else:
        return None
    full = shape(red.arg)
    why = _check_reduced(red, full)
    if why is None:
        local = local_of(res_arg, state)
        if not isinstance(res_arg, fx.Node) or shape(res_arg) != full:
            why = Refusal.BIAS_SHAPED
        elif local is None:
            why = Refusal.GATHERED_RESIDUAL if _is_gathered(res_arg) else Refusal.NOT_LOCAL
        elif not same_sharding(local, red.coll, full):
            why = Refusal.MIXED
        elif not other_readers_take_local(red, consumer):
            why = Refusal.READ_IN_FULL
    if why is not None:
        return _refuse(rule, consumer, why)
    return Match(rule, consumer, red, local, residual_first, res_arg)


def match_p2(norm: fx.Node, state: _State) -> Match | None:
    if not is_op(norm, ADD_RMS_NORM2):
        return None
    return _match_pair(Rule.P2, norm, norm.args[0], norm.args[1], state)


def match_p3(norm: fx.Node, state: _State) -> Match | None:
    if is_op(norm, ADD_RMS_NORM):
        return _match_pair(Rule.P3, norm, norm.args[0], norm.args[1], state)
    if not is_op(norm, RMS_NORM):
        return None
    add, chain = source_through_reshapes(norm.args[0], single_user=True)
    if not is_op(add, aten.add.Tensor) or len(add.users) != 1 or add.kwargs or len(add.args) != 2:
        return None
    if shape(add) is None or token_layout(shape(add)) != token_layout(shape(norm.args[0]) or ()):
        return _refuse(Rule.P3, norm, Refusal.MIXED)
    m = _match_pair(Rule.P3, add, add.args[0], add.args[1], state)
    if m is None:
        return None
    m.norm, m.add = norm, add
    return m


# --- rewrites --------------------------------------------------------------------------------

class Cursor:
    """Inserts new nodes one after another, starting after ``at``."""

    def __init__(self, at: fx.Node) -> None:
        self.at = at

    def call(self, target: object, args: tuple, meta_from: fx.Node) -> fx.Node:
        self.at = insert_call_after(self.at, target, args, meta_from=meta_from)
        return self.at

    def reshape(self, value: fx.Node, to: tuple[int, ...], meta_from: fx.Node) -> fx.Node:
        if shape(value) == tuple(to):
            return value
        return self.call(aten.reshape.default, (value, list(to)), meta_from)


def _leading_ones(full: tuple[int, ...], dim: int) -> bool:
    """Every dim before ``dim`` has size 1: splitting on ``dim`` is splitting on 0 of a view."""
    return all(d == 1 for d in full[:dim])


def emit_reduce_scatter(cur: Cursor, value: fx.Node, dim: int, parts: int, group: str,
                        meta_from: fx.Node) -> fx.Node:
    """``reduce_scatter(value, sum)`` along ``dim``. With only size-1 dims before ``dim`` it runs on
    dim 0 of a view (no copy); otherwise it splits on ``dim`` and cats on 0 first (the
    functional-collectives form). Returns this rank's slice in ``value``'s rank."""
    full = shape(value)
    local = (*full[:dim], full[dim] // parts, *full[dim + 1:])
    if dim != 0 and _leading_ones(full, dim):
        value = cur.reshape(value, full[dim:], meta_from)
    elif dim != 0:
        split = cur.call(aten.split.Tensor, (value, full[dim] // parts, dim), meta_from)
        items = [cur.call(operator.getitem, (split, i), meta_from) for i in range(parts)]
        value = cur.call(aten.cat.default, (items,), meta_from)
    rs = cur.call(c10d.reduce_scatter_tensor.default, (value, SUM, parts, group), meta_from)
    return cur.reshape(cur.call(c10d.wait_tensor.default, (rs,), meta_from), local, meta_from)


def emit_all_gather(cur: Cursor, value: fx.Node, dim: int, parts: int, group: str,
                    meta_from: fx.Node) -> fx.Node:
    """``all_gather(value)`` along ``dim``: on dim 0 of a view when only size-1 dims come before
    ``dim``, else gathered on 0, split into the ranks' blocks and cat on ``dim``."""
    local = shape(value)
    full = (*local[:dim], local[dim] * parts, *local[dim + 1:])
    flat = dim != 0 and _leading_ones(local, dim)
    if flat:
        value = cur.reshape(value, local[dim:], meta_from)
    ag = cur.call(c10d.all_gather_into_tensor.default, (value, parts, group), meta_from)
    wait = cur.call(c10d.wait_tensor.default, (ag,), meta_from)
    if dim == 0 or flat:
        return cur.reshape(wait, full, meta_from)
    split = cur.call(aten.split.Tensor, (wait, local[0]), meta_from)
    items = [cur.call(operator.getitem, (split, i), meta_from) for i in range(parts)]
    return cur.call(aten.cat.default, (items, dim), meta_from)


def _scatter(red: Reduced, full: tuple[int, ...], state: _State) -> fx.Node:
    """This rank's slice of the reduced value, in the consumer operand's layout ``full``."""
    c = red.coll
    cur = Cursor(c.op)
    v = cur.reshape(c.input, full, c.op)
    out = emit_reduce_scatter(cur, v, seq_dim(full), c.group_size, c.group_name, c.op)
    state.touched += [c.op, c.wait, *source_through_reshapes(red.arg, single_user=False)[1]]
    return out


def _gather(cur: Cursor, local: fx.Node, full: tuple[int, ...], c: Collective, like: fx.Node) -> fx.Node:
    """The full value of ``local`` in the shape of the node ``like`` it stands in for."""
    g = emit_all_gather(cur, local, seq_dim(full), c.group_size, c.group_name, like)
    return cur.reshape(g, shape(like), like)


def _give_full_to_other_readers(red: Reduced, local: fx.Node, full: tuple[int, ...], state: _State) -> None:
    """Readers of the reduced value besides the rewritten consumer read a gather of the slice."""
    wait = red.coll.value
    if not wait.users:
        return
    g = _gather(Cursor(local), local, full, red.coll, wait)
    wait.replace_all_uses_with(g)
    state.locals[g] = Local(local, full, red.coll.group_name, red.coll.group_size)


def rewrite(m: Match, state: _State) -> None:
    """Replace the matched all_reduce by a reduce_scatter, run the norm on the slice, gather."""
    c = m.reduced.coll
    full = shape(m.reduced.arg)
    lx = _scatter(m.reduced, full, state)
    cur = Cursor(m.norm.prev)
    if m.rule is Rule.P1:
        new = cur.call(RMS_NORM, (lx, *m.norm.args[1:]), m.norm)
        m.norm.replace_all_uses_with(_gather(cur, new, full, c, m.norm))
    else:
        lr = cur.reshape(m.residual.node, seq_local_shape(full, m.residual.parts), m.norm)
        state.touched += [m.residual_arg, *source_through_reshapes(m.residual_arg, single_user=False)[1]]
        ops = (lr, lx) if m.residual_first else (lx, lr)
        if m.add is not None:  # P3 on an add and a norm
            add = cur.call(aten.add.Tensor, ops, m.add)
            norm_in = shape(m.norm.args[0])
            x = cur.reshape(add, seq_local_shape(norm_in, c.group_size), m.norm)
            new = cur.call(RMS_NORM, (x, *m.norm.args[1:]), m.norm)
            m.norm.replace_all_uses_with(_gather(cur, new, norm_in, c, m.norm))
            state.touched += [m.add, *source_through_reshapes(m.norm.args[0], single_user=True)[1]]
        elif m.rule is Rule.P3:  # add_rms_norm
            new = cur.call(ADD_RMS_NORM, (*ops, *m.norm.args[2:]), m.norm)
            m.norm.replace_all_uses_with(_gather(cur, new, full, c, m.norm))
        else:
            new = cur.call(ADD_RMS_NORM2, (*ops, *m.norm.args[2:]), m.norm)
            for item in sorted(m.norm.users, key=lambda u: u.args[1]):
                local = cur.call(operator.getitem, (new, item.args[1]), item)
                g = _gather(cur, local, full, c, item)
                item.replace_all_uses_with(g)
                state.touched.append(item)
                if item.args[1] == 1:  # the sum: later rules read its slice
                    state.locals[g] = Local(local, full, c.group_name, c.group_size)
    state.touched.append(m.norm)
    _give_full_to_other_readers(m.reduced, lx, full, state)


def _erase_dead(graph: fx.Graph, removable: set[fx.Node]) -> None:
    """Erase, last first, the unread nodes among ``removable`` (the old consumers and reshape
    chains, the all_reduces, and gathers whose readers all took the slice)."""
    changed = True
    while changed:
        changed = False
        for n in reversed(graph.nodes):
            if n in removable and n.op == "call_function" and not n.users:
                graph.erase_node(n)
                changed = True


def apply(gm: fx.GraphModule) -> int:
    """Apply P1, P2, P3 in that order; returns the number of all_reduces rewritten."""
    state = _State()
    before = set(gm.graph.nodes)
    count = 0
    for rule, finder in ((Rule.P1, lambda n: match_p1(n)), (Rule.P2, lambda n: match_p2(n, state)),
                         (Rule.P3, lambda n: match_p3(n, state))):
        for node in list(gm.graph.nodes):
            if node in state.touched:
                continue
            m = finder(node)
            if m is not None:
                rewrite(m, state)
                count += 1
        log.debug("sequence_parallel: %d rewrites after %s", count, rule.name)
    _erase_dead(gm.graph, (set(gm.graph.nodes) - before) | set(state.touched))
    gm.graph.lint()
    gm.recompile()
    return count
