"""Mixture-of-experts routing in an exported program: recognised, then imported as ``topk``,
``take``, ``dispatch`` and ``combine``.

A sparse mixture of experts written as the reference Mixtral is (router softmax, ``topk``,
gates renormalised, a one-hot routing mask, ``torch.where`` on each expert's mask, the expert
on ``x[token]``, ``index_add_`` of its output weighted by the gates) exports to a graph of
data-dependent sizes: ``nonzero``, ``index.Tensor``, ``index_put``, with assertions on the
symbolic sizes. None of it has an IR op of its own, but the whole has: :func:`recognise` finds
each ``topk`` of such a pattern and gives every node of it a role; the importer then emits

* ``topk`` on the router's int8 logits (the softmax is monotone, so the experts are the same,
  and the logits keep more distinct values than int8 probabilities);
* the gates: renormalised top-k probabilities are ``softmax`` over the ``take`` of the top-k
  logits (``p_i / sum_j p_j = exp(l_i) / sum_j exp(l_j)`` over the chosen ``j``; for top-1
  the constant 1); gates that are not renormalised are the ``take`` of the router's softmax;
* per expert, ``dispatch`` (its tokens' rows, a run-time number of rows) and the expert's own
  ops on those rows;
* one ``combine`` of every expert's output (rescaled to one scale) weighted by the gates,
  requantized to the scale of the model's result.

The assertion and symbolic-size nodes carry no data and are dropped. Recognition is by the
graph's structure (users and operands, not the order torch emits the nodes in) and by the
meaning of the routing mask, checked by running its nodes on probe indices: a variant that is
not recognised is refused naming the node where it departs, rather than imported wrongly.
The nodes of an expert must be row-wise (the expert sees its tokens in torch's order, the IR's
``dispatch`` in ascending token order: the same rows, permuted).

torch is imported only inside :func:`recognise` (an optional dependency, ``rdakit[torch]``).
"""

import dataclasses

import numpy as np

from rdakit.compiler.frontend.aten import ATEN_OPS, op_name

__all__ = ["ROUTING_OPS", "Routing", "Expert", "Plan", "RoutingError", "recognise",
           "routed_nodes"]

#: Op kinds that are imported only as part of a recognised routing pattern (any other use is
#: refused naming the node).
ROUTING_OPS = frozenset(name for name, op in ATEN_OPS.items() if op.routing)

_ASSERTS = {"aten._assert_async.msg", "aten._assert_scalar.default",
            "aten._assert_tensor_metadata.default"}
#: Ops that may feed an assertion only (the checks of one_hot and of the symbolic sizes).
_CHECKS = {"aten.ge.Scalar", "aten.lt.Scalar", "aten.le.Scalar", "aten.gt.Scalar",
           "aten.logical_not.default", "aten.any.dims", "aten.any.default",
           "aten.sym_size.int", "operator.ge", "operator.le", "operator.lt", "operator.gt"}
#: Ops allowed between the top-k indices and an expert's ``nonzero`` (the one-hot mask).
_MASK_OPS = {"aten.unsqueeze.default", "aten.eq.Tensor", "aten.eq.Scalar",
             "aten._to_copy.default", "aten.permute.default", "aten.select.int",
             "aten.transpose.int", "aten.clone.default", "aten.alias.default",
             "aten.view.default", "aten.squeeze.dim"}
_SOFTMAX = {"aten.softmax.int", "aten._softmax.default", "aten._safe_softmax.default"}
_ZEROS = {"aten.full_like.default", "aten.zeros_like.default", "aten.zeros.default",
          "aten.full.default", "aten.new_zeros.default"}
#: Ops an expert may apply to its rows (each output row depends on its own input row only,
#: provided the other operands are constants that do not vary along the rows).
_ROWWISE = {"aten.linear.default", "aten.mm.default", "aten.addmm.default",
            "aten.silu.default", "aten.gelu.default",
            "aten.relu.default", "aten.mul.Tensor", "aten.add.Tensor", "aten.sub.Tensor",
            "aten.div.Tensor", "aten.neg.default", "aten.clamp.default",
            "aten.hardtanh.default", "aten.clone.default", "aten.contiguous.default",
            "aten.alias.default", "aten.detach.default", "aten.dropout.default"}
_MATMULS = {"aten.linear.default", "aten.mm.default", "aten.addmm.default"}
_VIEWS = {"aten.unsqueeze.default", "aten.view.default", "aten.reshape.default",
          "aten.squeeze.dim", "aten.alias.default", "aten.clone.default"}


class RoutingError(Exception):
    """A routing pattern the importer does not recognise, at ``node``."""

    def __init__(self, node, message):
        super().__init__(message)
        self.node = node


@dataclasses.dataclass
class Expert:
    """One expert of a routing: its index, the node gathering its tokens' rows (``x[token]``),
    its own nodes (row-wise, on a run-time number of rows), its output and the scatter of the
    gated output."""

    index: int
    gather: object
    region: list
    output: object
    scatter: object


@dataclasses.dataclass
class Routing:
    """One recognised mixture of experts."""

    topk: object
    logits: object             # the node whose top-k are the experts (the router's logits)
    k: int
    experts: int
    renormalised: bool         # gates renormalised over the chosen experts
    probs: object              # the router's softmax node (None if topk reads the logits)
    tokens: object             # the (tokens, d) node the experts' rows are gathered from
    members: list              # Expert, by index
    result: object             # the last scatter: the combined output


@dataclasses.dataclass
class Plan:
    """The routings of a program and the role of each of their nodes (by name):
    ``("topk", routing)``, ``("gather", routing, expert)``, ``("gated", routing, expert)``,
    ``("result", routing)``, ``("drop", None)`` (no data, or data only the pattern reads)."""

    routings: list
    roles: dict

    @property
    def dynamic(self):
        """Rows bound (tokens) of each node computed on an expert's run-time rows."""
        return {n.name: _rows(r.tokens) for r in self.routings for m in r.members
                for n in [m.gather] + m.region}


def _rows(node):
    return int(node.meta["val"].shape[0])


def _users(node):
    return list(node.users)


def _live_users(node, live):
    return [u for u in node.users if u.name in live]


def _args(torch, node):
    """The node's arguments by schema name (``self``/``input`` as given)."""
    from torch.fx.operator_schemas import normalize_function
    pair = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                              normalize_to_only_use_kwargs=True)
    return pair.kwargs if pair is not None else dict(node.kwargs)


def _first(kw):
    return kw.get("self", kw.get("input"))


def _ndim(node):
    return len(node.meta["val"].shape)


def _int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _assert_only(program):
    """Names of the nodes that only feed assertions (and the assertions)."""
    out = set()
    for n in reversed(list(program.graph.nodes)):
        if n.op != "call_function":
            continue
        name = op_name(n.target)
        if name in _ASSERTS or (name in _CHECKS and n.users
                                and all(u.name in out for u in n.users)):
            out.add(n.name)
    return out


def routed_nodes(program, live):
    """Names of the nodes of the routings :func:`recognise` accepts (empty if it refuses one),
    for the op coverage."""
    try:
        return set(recognise(program, live).roles)
    except RoutingError:
        return set()


def recognise(program, live):
    """The :class:`Plan` of ``program``'s routings (its graph as the importer walks it; ``live``
    the nodes that depend on a user input).

    Raises
    ------
    RoutingError
        For a ``topk`` whose routing is not the recognised pattern, naming the node where it
        departs from it.
    """
    # torch is optional (rdakit[torch]); only a caller holding a program gets here.
    import torch

    roles = {name: ("drop", None) for name in _assert_only(program) if name in live}
    routings = []
    for node in program.graph.nodes:
        if node.op == "call_function" and node.name in live \
                and op_name(node.target) == "aten.topk.default":
            routing = _routing(torch, program, live, node, roles)
            routings.append(routing)
    return Plan(routings, roles)


def _fail(node, message):
    raise RoutingError(node, message)


def _routing(torch, program, live, topk, roles):
    kw = _args(torch, topk)
    source = _first(kw)
    k = int(kw["k"])
    if _ndim(source) != 2 or _int(kw.get("dim", -1)) not in (-1, 1) \
            or not kw.get("largest", True):
        _fail(topk, "a routing top-k must take the k largest of a 2-D (tokens, experts) "
                    "tensor along its last dimension")
    tokens, experts = (int(d) for d in source.meta["val"].shape)
    probs, logits = None, source
    if op_name(source.target) in _SOFTMAX and _int(_args(torch, source)["dim"]) in (-1, 1):
        probs, logits = source, _first(_args(torch, source))
    values = indices = None
    for u in _users(topk):
        if op_name(u.target) != "operator.getitem":
            _fail(u, "the top-k's results may only be picked (values, indices)")
        if u.args[1] == 0:
            values = u
        else:
            indices = u
    if indices is None:
        _fail(topk, "the top-k's indices are not used: not a routing")
    gates, renormalised, dropped = _gates(torch, topk, values, probs)
    routing = Routing(topk, logits, k, experts, renormalised, probs, None, [], None)
    if probs is not None and all(u is topk for u in probs.users):
        roles[probs.name] = ("drop", None)
    roles[topk.name] = ("topk", routing)
    for n in dropped + [indices] + ([values] if values is not None else []):
        roles.setdefault(n.name, ("drop", None))
    members, scatters = {}, {}
    for z in _nonzeros(indices, live, roles, topk):
        e, token_major = _mask_meaning(torch, program, live, roles, indices, z, tokens,
                                       k, experts)
        if e in members:
            _fail(z, f"expert {e} is routed twice")
        members[e] = _expert(torch, live, roles, routing, z, e, token_major, gates)
        scatters[members[e].scatter.name] = members[e]
    missing = sorted(set(range(experts)) - set(members))
    if missing:
        _fail(topk, f"the routing to expert(s) {missing} of {experts} is not found (every "
                    f"expert needs its nonzero, x[token] and index_put)")
    routing.members = [members[e] for e in range(experts)]
    routing.tokens = routing.members[0].gather.args[0]
    routing.result = _scatter_chain(torch, routing, scatters, roles)
    for m in routing.members:
        roles[m.gather.name] = ("gather", routing, m)
        roles[m.scatter.name] = ("gated", routing, m)
    roles[routing.result.name] = ("result", routing)
    return routing


def _gates(torch, topk, values, probs):
    """The gates node, whether renormalised, and the nodes computing it (dropped)."""
    if values is None:
        _fail(topk, "the top-k's values (the gates) are not used")
    users = _users(values)
    names = sorted(op_name(u.target) for u in users)
    if probs is not None and names == ["aten.div.Tensor", "aten.sum.dim_IntList"]:
        s = next(u for u in users if op_name(u.target) == "aten.sum.dim_IntList")
        d = next(u for u in users if op_name(u.target) == "aten.div.Tensor")
        skw, dkw = _args(torch, s), _args(torch, d)
        if list(skw.get("dim") or []) not in ([-1], [1]) or not skw.get("keepdim") \
                or _first(dkw) is not values or dkw.get("other") is not s \
                or dkw.get("rounding_mode") is not None or list(s.users) != [d]:
            _fail(d, "gates renormalised otherwise than values / values.sum(-1, keepdim=True)")
        return d, True, [s, d]
    if probs is None:
        if names == ["aten.softmax.int"] or names == ["aten._softmax.default"]:
            sm = users[0]
            if _int(_args(torch, sm)["dim"]) not in (-1, 1):
                _fail(sm, "the gates' softmax must be over the chosen experts (the last "
                          "dimension)")
            return sm, True, [sm]
        _fail(topk, "a routing top-k of logits needs a softmax of the chosen logits as its "
                    "gates")
    return values, False, []


def _nonzeros(indices, live, roles, topk):
    """The ``nonzero`` nodes reached from the top-k indices through mask ops; every other
    use of the indices refused (assertions aside)."""
    found, seen, todo = [], set(), [indices]
    while todo:
        n = todo.pop()
        for u in _users(n):
            if u.name in seen or (roles.get(u.name) == ("drop", None)
                                  and op_name(u.target) in _ASSERTS | _CHECKS):
                continue
            seen.add(u.name)
            name = op_name(u.target)
            if name == "aten.nonzero.default":
                found.append(u)
            elif name in _MASK_OPS:
                roles[u.name] = ("drop", None)
                todo.append(u)
            else:
                _fail(u, f"the routing indices of {topk.name} are used by {name}, which is not "
                         f"part of the recognised routing (one-hot mask, nonzero)")
    found.sort(key=lambda z: z.name)
    return found


def _constant(torch, program, node, cache):
    """The value of a node that reads no user input (weights, arange), computed."""
    if node.name in cache:
        return cache[node.name]
    if node.op == "placeholder":
        spec = next(s for s in program.graph_signature.input_specs if s.arg.name == node.name)
        state = {**program.state_dict, **program.constants}
        value = state[spec.target]
    else:
        args = torch.fx.node.map_arg(node.args, lambda a: _constant(torch, program, a, cache))
        kwargs = torch.fx.node.map_arg(node.kwargs,
                                       lambda a: _constant(torch, program, a, cache))
        value = node.target(*args, **kwargs)
    cache[node.name] = value
    return value


def _run(torch, program, node, env, cache):
    """``node`` on the values of ``env`` (the probe's), its constant operands computed."""
    if node.op != "call_function":
        return _constant(torch, program, node, cache)

    def value(a):
        return env[a.name] if a.name in env else _constant(torch, program, a, cache)
    args = torch.fx.node.map_arg(node.args, value)
    kwargs = torch.fx.node.map_arg(node.kwargs, value)
    return node.target(*args, **kwargs)


def _mask_meaning(torch, program, live, roles, indices, z, tokens, k, experts):
    """Which expert ``z`` (a nonzero) selects and whether its mask is (tokens, k) or (k,
    tokens): the mask's nodes run on probe indices (distinct experts in each row, as top-k's
    are) and compared with ``indices == e``."""
    chain, todo = {}, [z.args[0]]
    while todo:
        n = todo.pop()
        if n is indices or n.name in chain:
            continue
        if n.name in live and roles.get(n.name) != ("drop", None):
            _fail(z, f"the routing mask reads {n.name}, which is not the top-k indices")
        chain[n.name] = n
        todo.extend(a for a in n.all_input_nodes if a is not indices)
    order = [n for n in z.graph.nodes if n.name in chain]
    rng = np.random.default_rng(0)
    found = None
    cache = {}
    for _ in range(3):
        probe = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)])
        env = {indices.name: torch.as_tensor(probe, dtype=torch.int64)}
        for n in order:
            env[n.name] = _run(torch, program, n, env, cache)
        mask = env[z.args[0].name]
        mask = mask.detach().numpy() != 0 if hasattr(mask, "detach") else None
        meanings = set()
        for e in range(experts):
            hit = probe == e
            if mask is not None and mask.shape == hit.shape and (mask == hit).all():
                meanings.add((e, True))
            if mask is not None and mask.shape == hit.T.shape and (mask == hit.T).all():
                meanings.add((e, False))
        found = meanings if found is None else found & meanings
    if not found or len(found) > 1:
        _fail(z, "the mask of this nonzero is not one expert's column of the top-k indices' "
                 "one-hot (indices == e, as (tokens, k) or (k, tokens))")
    return found.pop()


def _expert(torch, live, roles, routing, z, e, token_major, gates):
    """The expert ``e`` reached from its ``nonzero`` ``z``."""
    roles[z.name] = ("drop", None)
    picks = _coordinates(torch, z, roles)
    token, slot = (picks.get(0), picks.get(1)) if token_major else (picks.get(1), picks.get(0))
    if token is None:
        _fail(z, "the tokens routed to an expert are not used")
    gather = weight = scatter = None
    for u in _users(token):
        name = op_name(u.target)
        kw = _args(torch, u)
        idx = kw.get("indices")
        if name == "aten.index.Tensor" and idx == [token]:
            if gather is not None:
                _fail(u, "an expert's rows are gathered twice")
            gather = u
        elif name == "aten.index.Tensor" and slot is not None and idx == [token, slot]:
            weight = u
        elif name == "aten.index_put.default" and kw.get("indices") == [token] \
                and kw.get("accumulate"):
            scatter = u
        elif name == "aten.index_add.default" and _int(kw.get("dim")) == 0 \
                and kw.get("index") is token and kw.get("alpha", 1) == 1:
            scatter = u
        else:
            _fail(u, f"the tokens routed to expert {e} are used by {name}, which is not part "
                     f"of the recognised routing (x[token], gates[token, slot], index_put or "
                     f"index_add_ accumulating at token)")
    if slot is not None:
        for u in _users(slot):
            if u is not weight:
                _fail(u, f"the routing slots of expert {e} are used otherwise than to pick "
                         f"its gates")
    for what, n in (("x[token]", gather), ("gates[token, slot]", weight),
                    ("index_put/index_add_", scatter)):
        if n is None:
            _fail(z, f"the routing to expert {e} has no {what}")
    x = gather.args[0]
    if _ndim(x) != 2 or _rows(x) != _rows(routing.topk.args[0]) or x.name not in live:
        _fail(gather, "an expert's rows must be gathered from a (tokens, d) activation with a "
                      "row per routed token")
    # gates[token, slot] (optionally with a unit dimension) up to the product.
    src = weight.args[0]
    while src is not gates:
        if op_name(src.target) not in _VIEWS or len(src.users) != 1:
            _fail(weight, "the weights of an expert's rows must be picked from the gates")
        roles[src.name] = ("drop", None)
        src = src.args[0]
    roles[weight.name] = ("drop", None)
    w = weight
    while len(w.users) == 1 and op_name(next(iter(w.users)).target) in _VIEWS:
        w = next(iter(w.users))
        roles[w.name] = ("drop", None)
    if len(w.users) != 1 or op_name(next(iter(w.users)).target) != "aten.mul.Tensor":
        _fail(w, f"expert {e}'s gates must multiply its output")
    product = next(iter(w.users))
    kw = _args(torch, product)
    output = kw["other"] if _first(kw) is w else _first(kw)
    if {product.name} != {u.name for u in output.users if u is product} or \
            list(product.users) != [scatter]:
        _fail(product, f"expert {e}'s gated output must only be added into the result")
    values = kw_values(torch, scatter)
    if values is not product:
        _fail(scatter, f"expert {e}'s scatter must add its gated output")
    roles[product.name] = ("drop", None)
    region = _region(torch, live, gather, output, product, e)
    return Expert(e, gather, region, output, scatter)


def _coordinates(torch, z, roles):
    """The columns of the nonzero ``z`` (``torch.where``'s results) by index: ``unbind(z, 1)``
    and its picks, ``select(z, 1, c)``, or ``slice(z, 1, c, c + 1)`` squeezed (as torch's
    decompositions spell unbind)."""
    picks = {}

    def pick(c, node):
        if c in picks:
            _fail(node, "a coordinate of a routing nonzero is taken twice")
        picks[c] = node
        roles[node.name] = ("drop", None)

    for u in _users(z):
        if roles.get(u.name) == ("drop", None):
            continue                        # its size, for the assertions
        name = op_name(u.target)
        kw = _args(torch, u)
        if name == "aten.unbind.int" and _int(kw.get("dim", 0)) in (1, -1):
            roles[u.name] = ("drop", None)
            for g in _users(u):
                if op_name(g.target) != "operator.getitem":
                    _fail(g, "the coordinates of a routing nonzero may only be picked")
                pick(g.args[1], g)
        elif name == "aten.select.int" and _int(kw.get("dim")) in (1, -1):
            pick(_int(kw["index"]), u)
        elif name == "aten.slice.Tensor" and _int(kw.get("dim")) in (1, -1) \
                and kw.get("step", 1) == 1 and len(u.users) == 1 \
                and op_name(next(iter(u.users)).target) in ("aten.squeeze.dims",
                                                           "aten.squeeze.dim") \
                and _int(kw.get("end")) == _int(kw.get("start")) + 1:
            roles[u.name] = ("drop", None)
            pick(_int(kw["start"]), next(iter(u.users)))
        else:
            _fail(u, "the nonzero of a routing mask must be split into its coordinates "
                     "(torch.where: unbind, select or a slice of dimension 1)")
    return picks


def kw_values(torch, scatter):
    kw = _args(torch, scatter)
    return kw.get("values", kw.get("source"))


def _region(torch, live, gather, output, product, e):
    """The expert's nodes from its gathered rows to its output, each row-wise."""
    region, todo, seen = [], [gather], {gather.name}
    while todo:
        n = todo.pop()
        for u in n.users:
            if u is not product and u.name not in seen:
                seen.add(u.name)
                region.append(u)
                todo.append(u)
    # Only what the output is computed from: anything else reading the rows is refused below.
    feeds, todo = {output.name}, [output]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a.name in seen and a.name not in feeds:
                feeds.add(a.name)
                todo.append(a)
    region = [n for n in region if n.name in feeds]
    seen = {gather.name} | {n.name for n in region}
    for u in region:
        name = op_name(u.target)
        if name not in _ROWWISE:
            _fail(u, f"expert {e} applies {name} to its rows; an expert may only use "
                     f"row-wise ops ({', '.join(sorted(s.split('.')[1] for s in _ROWWISE))})")
        for a in u.all_input_nodes:
            if a.name in seen:
                continue
            if a.name in live:
                _fail(u, f"expert {e} reads {a.name}, an activation outside its rows")
            val = a.meta.get("val")
            if name not in _MATMULS and val is not None and len(val.shape) >= 2 \
                    and int(val.shape[0]) != 1:
                _fail(u, f"expert {e} combines its rows with a constant that varies along "
                         f"them ({a.name})")
    if output is not gather and output.name not in seen:
        _fail(product, f"expert {e}'s gated output is not computed from its rows")
    for n in [gather] + region:
        for u in n.users:
            if u is not product and u.name not in seen:
                _fail(u, f"expert {e}'s intermediate {n.name} is used outside the expert")
    order = {n.name: i for i, n in enumerate(gather.graph.nodes)}
    return sorted(region, key=lambda n: order[n.name])


def _scatter_chain(torch, routing, scatters, roles):
    """The experts' scatters must accumulate, one after the other, into zeros of the result's
    shape: the last one is the combined output."""
    ends = []
    for m in scatters.values():
        acc = _first(_args(torch, m.scatter))
        if acc.name in scatters:
            if len(acc.users) != 1:
                _fail(acc, "an expert's partial sum is read outside the routing")
            continue
        if op_name(acc.target) not in _ZEROS:
            _fail(m.scatter, f"expert {m.index}'s output is added into {acc.name}, not into "
                             f"the zeros of the result or another expert's partial sum")
        fill = _args(torch, acc).get("fill_value", 0)
        shape = tuple(acc.meta["val"].shape)
        if fill != 0 or len(shape) != 2 or shape[0] != _rows(routing.tokens) \
                or shape != tuple(m.scatter.meta["val"].shape) or len(acc.users) != 1:
            _fail(acc, "the experts' outputs must be added into zeros of the result's shape")
        roles[acc.name] = ("drop", None)
        ends.append(m.scatter)
    if len(ends) != 1:
        _fail(routing.topk, "the experts' outputs must be added into one result")
    node, count = ends[0], 1
    while True:
        nxt = [u for u in node.users if u.name in scatters]
        if not nxt:
            break
        node, count = nxt[0], count + 1
    if count != len(scatters):
        _fail(routing.topk, "the experts' outputs must be added into one result")
    return node
