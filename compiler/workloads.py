"""Workloads for the compiler: dataflow graphs with sample inputs and numpy references.

Each builder returns a :class:`Workload`: a validated :class:`~rdakit.compiler.graph.DataflowGraph`,
deterministic sample inputs (from ``seed``) and a *reference*, a plain numpy implementation
written independently of the graph's op table, that computes the expected outputs. All
arithmetic is integer: int8 activations and weights, int32 accumulation with wraparound, and
requantization by an arithmetic right shift followed by saturation to int8, so that outputs can
later be compared bit-exactly with the RTL.

Builders (sizes are options):

- :func:`mlp`: fully connected layers with bias and ReLU.
- :func:`decoder_step`: one step of a transformer decoder layer with a KV cache holding
  ``cache_len`` entries; the step appends one entry to each cache (``append``), so step ``t``
  is built with ``cache_len=t`` and :func:`run_decoder` chains steps.
- :func:`moe`: a mixture-of-experts layer with top-k gating; :func:`switch` (k = 1) and
  :func:`mixtral` (8 experts, k = 2) are presets. Expert inputs (``dispatch``) have a number of
  rows known only at run time.

:func:`load_graph` loads a user's graph from a Python file.
"""

import dataclasses
import functools
import pathlib
import runpy
from collections.abc import Callable

import numpy as np

from rdakit.compiler.graph import DataflowGraph, GraphError

__all__ = [
    "Workload", "WORKLOADS", "build", "mlp", "decoder_step", "run_decoder", "moe", "switch",
    "mixtral", "load_graph",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
    """A dataflow graph with sample inputs and a reference implementation.

    Members
    -------
    name : str
        Name, with the sizes (for tables).
    graph : DataflowGraph
        The validated graph.
    sample : dict or callable
        The sample inputs, or a function of no arguments that makes them: they are made when
        :attr:`inputs` is first read, so a size no fabric holds is refused (by the compiler's
        fit check) before they are allocated.
    reference : callable
        ``reference(inputs) -> dict`` of expected outputs, by output name.
    options : dict
        The builder's options.
    """

    name: str
    graph: DataflowGraph
    sample: dict | Callable
    reference: Callable
    options: dict

    @functools.cached_property
    def inputs(self):
        """Sample inputs (dict of str to numpy.ndarray), deterministic from the builder's
        ``seed``; made on first use."""
        return self.sample() if callable(self.sample) else self.sample

    def expected(self):
        """Outputs of the reference on the sample inputs."""
        return self.reference(self.inputs)

    def check(self, inputs=None):
        """Whether the graph's evaluation equals the reference, bit for bit."""
        inputs = self.inputs if inputs is None else inputs
        got, want = self.graph.evaluate(inputs), self.reference(inputs)
        return sorted(got) == sorted(want) and all(
            got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]) for k in want)


# --- integer helpers of the references (deliberately not the op table) ----------------------

def _mm(a, b):
    return (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32)


def _rq(x, shift, lo=-128, hi=127):
    """Requantize: arithmetic right shift, then saturate to int8."""
    return np.clip(x.astype(np.int32) >> shift, lo, hi).astype(np.int8)


def _shift_for(k):
    """Right shift that keeps a K-term int8 dot product of the sample ranges roughly in int8."""
    return 1 + (int(k).bit_length() + 1) // 2


def _check_sizes(**sizes):
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TypeError(f"{name} must be a positive integer, not {value!r}")


def _weights(rng, shape):
    return rng.integers(-8, 8, size=shape, dtype=np.int8)


def _activations(rng, shape):
    return rng.integers(-32, 32, size=shape, dtype=np.int8)


def _requant(g, x, shift, prefix, *, lo=-128):
    return g.add("clip", g.add("shr", x, name=f"{prefix}_shr", shift=shift), name=prefix,
                 lo=lo, hi=127, dtype="int8")


# --- MLP -------------------------------------------------------------------------------------

def mlp(*, batch=4, sizes=(64, 128, 64), seed=0):
    """Fully connected layers ``x -> relu(x @ W + b) >> s`` (no ReLU after the last).

    Parameters
    ----------
    batch : int
        Rows of the input.
    sizes : sequence of int
        Widths: input, hidden layers..., output (at least two).
    seed : int
        Seed of the weights and sample inputs.
    """
    _check_sizes(batch=batch)
    sizes = tuple(sizes)
    if len(sizes) < 2:
        raise TypeError(f"sizes must have at least two widths, not {sizes!r}")
    _check_sizes(**{f"sizes[{i}]": s for i, s in enumerate(sizes)})
    rng = np.random.default_rng(seed)
    layers = []
    for i, (m, n) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append((_weights(rng, (m, n)), rng.integers(-256, 256, size=(n,), dtype=np.int32),
                       _shift_for(m), i < len(sizes) - 2))
    g = DataflowGraph(f"mlp_b{batch}_" + "x".join(map(str, sizes)))
    x = g.input("x", (batch, sizes[0]), "int8")
    for i, (w, b, shift, relu) in enumerate(layers):
        h = g.add("matmul", x, g.const(f"w{i}", w), name=f"fc{i}")
        h = g.add("add", h, g.const(f"b{i}", b), name=f"bias{i}")
        if relu:
            h = g.add("relu", h, name=f"relu{i}")
        x = _requant(g, h, shift, f"act{i}")
    g.output("y", x)

    def reference(inputs):
        a = inputs["x"]
        for w, b, shift, relu in layers:
            h = (_mm(a, w).astype(np.int64) + b).astype(np.int32)
            if relu:
                h = np.maximum(h, 0)
            a = _rq(h, shift)
        return {"y": a}

    return Workload(g.name, g.validate(), lambda: {"x": _activations(rng, (batch, sizes[0]))},
                    reference, {"batch": batch, "sizes": sizes, "seed": seed})


# --- transformer decoder step with a KV cache -----------------------------------------------

def decoder_step(*, d_model=64, heads=4, d_ff=128, cache_len=8, batch=1, seed=0):
    """One decoding step of a transformer layer whose KV cache grows by one entry, for
    ``batch`` sequences at once (batched decoding, as a server with continuous batching runs
    it: one new token of each sequence, each sequence with its own cache).

    Integer attention: scores ``q . K^T``, then ReLU attention (``relu(scores) >> s``
    saturated to [0, 127], an integer stand-in for softmax), then ``p @ V``; a residual
    connection, and a ReLU feed-forward block with a second residual. The projections, the
    output projection and the feed-forward block take the ``batch`` tokens as the rows of one
    matmul; attention is per sequence, over its own cache.

    Inputs ``x`` (batch, d_model) and the caches ``k_cache`` and ``v_cache`` (cache_len,
    d_model), all int8; with several sequences each has caches of its own, ``s{i}_k_cache``
    and ``s{i}_v_cache`` for sequence ``i`` (a server keeps each sequence's cache apart, so
    each grows in place). Outputs ``y`` (batch, d_model) and the caches with one more entry,
    ``k_cache_out`` and ``v_cache_out`` (``s{i}_k_cache_out`` and ``s{i}_v_cache_out``), which
    are the caches of the next step. With several sequences and an empty cache
    (``cache_len=0``) there are no cache inputs.

    Parameters
    ----------
    d_model, heads, d_ff : int
        Model width, attention heads (dividing ``d_model``) and feed-forward width.
    cache_len : int
        Entries already in each cache (0 for the first step).
    batch : int
        Sequences decoded at once (one token each).
    seed : int
        Seed of the weights (the same for every step) and sample inputs.
    """
    _check_sizes(d_model=d_model, heads=heads, d_ff=d_ff, batch=batch)
    if not isinstance(cache_len, int) or cache_len < 0:
        raise TypeError(f"cache_len must be a non-negative integer, not {cache_len!r}")
    if d_model % heads:
        raise ValueError(f"heads must divide d_model ({d_model}), not {heads!r}")
    dh = d_model // heads
    rng = np.random.default_rng(seed)
    w = {n: _weights(rng, (d_model, d_model)) for n in ("wq", "wk", "wv", "wo")}
    w["w1"], w["w2"] = _weights(rng, (d_model, d_ff)), _weights(rng, (d_ff, d_model))
    s_in, s_att, s_ctx, s_ff = (_shift_for(d_model), _shift_for(dh) + 2,
                                _shift_for(cache_len + 1) + 4, _shift_for(d_ff))
    batched = "" if batch == 1 else f"_b{batch}"
    g = DataflowGraph(f"decoder_d{d_model}_h{heads}_f{d_ff}_t{cache_len}{batched}")
    x = g.input("x", (batch, d_model), "int8")
    cached = batch == 1 or cache_len > 0
    pres = [""] if batch == 1 else [f"s{i}_" for i in range(batch)]
    caches = {f"{pre}{n}": g.input(f"{pre}{n}", (cache_len, d_model), "int8")
              for pre in pres for n in ("k_cache", "v_cache") if cached}
    proj = {}
    for n in ("q", "k", "v"):
        m = g.add("matmul", x, g.const(f"w{n}", w[f"w{n}"]), name=f"{n}_proj")
        proj[n] = _requant(g, m, s_in, n)
    seq_ctx, appended = [], {"k": [], "v": []}
    for i, pre in enumerate(pres):
        new = {n: proj[n] if batch == 1 else
               g.add("slice", proj[n], name=f"{pre}{n}", axis=0, start=i, stop=i + 1)
               for n in ("q", "k", "v")}
        for n in ("k", "v"):
            appended[n].append(g.add("append", caches[f"{pre}{n}_cache"], new[n],
                                     name=f"{pre}{n}_append") if cached else new[n])
        for n in ("k", "v"):
            g.output(f"{pre}{n}_cache_out", appended[n][-1])
        ctx = []
        for h in range(heads):
            cols = {"axis": 1, "start": h * dh, "stop": (h + 1) * dh}
            qh = g.add("slice", new["q"], name=f"{pre}h{h}_q", **cols)
            kh = g.add("slice", appended["k"][-1], name=f"{pre}h{h}_k", **cols)
            vh = g.add("slice", appended["v"][-1], name=f"{pre}h{h}_v", **cols)
            s = g.add("matmul", qh, g.add("transpose", kh, name=f"{pre}h{h}_kt"),
                      name=f"{pre}h{h}_scores")
            s = g.add("relu", s, name=f"{pre}h{h}_relu")
            p = _requant(g, s, s_att, f"{pre}h{h}_p", lo=0)
            ctx.append(_requant(g, g.add("matmul", p, vh, name=f"{pre}h{h}_pv"), s_ctx,
                                f"{pre}h{h}_ctx"))
        seq_ctx.append(g.add("concat", *ctx, name=f"{pre}ctx", axis=1))
    c = seq_ctx[0] if batch == 1 else g.add("concat", *seq_ctx, name="ctx", axis=0)
    o = _requant(g, g.add("matmul", c, g.const("wo", w["wo"]), name="o_proj"), s_in, "o")
    h1 = g.add("clip", g.add("add", x, o, name="res1_add"), name="res1", dtype="int8")
    f = g.add("relu", g.add("matmul", h1, g.const("w1", w["w1"]), name="ff1"), name="ff1_relu")
    f = _requant(g, f, s_in, "ff1_act")
    f2 = _requant(g, g.add("matmul", f, g.const("w2", w["w2"]), name="ff2"), s_ff, "ff2_act")
    y = g.add("clip", g.add("add", h1, f2, name="res2_add"), name="res2", dtype="int8")
    g.output("y", y)

    def reference(inputs):
        xv = inputs["x"]
        q, k, v = (_rq(_mm(xv, w[f"w{n}"]), s_in) for n in ("q", "k", "v"))
        k_all, v_all, ctx = [], [], []
        for i, pre in enumerate(pres):
            kc = inputs[f"{pre}k_cache"] if cached else k[:0]
            vc = inputs[f"{pre}v_cache"] if cached else v[:0]
            k_all.append(np.concatenate([kc, k[i:i + 1]]))
            v_all.append(np.concatenate([vc, v[i:i + 1]]))
            for h in range(heads):
                sl = slice(h * dh, (h + 1) * dh)
                scores = np.maximum(_mm(q[i:i + 1, sl], k_all[-1][:, sl].T), 0)
                p = _rq(scores, s_att, lo=0)
                ctx.append(_rq(_mm(p, v_all[-1][:, sl]), s_ctx))
        c = np.concatenate(ctx, axis=1).reshape(batch, d_model)
        o = _rq(_mm(c, w["wo"]), s_in)
        h1 = np.clip(xv.astype(np.int32) + o, -128, 127).astype(np.int8)
        f = _rq(np.maximum(_mm(h1, w["w1"]), 0), s_in)
        f2 = _rq(_mm(f, w["w2"]), s_ff)
        y = np.clip(h1.astype(np.int32) + f2, -128, 127).astype(np.int8)
        caches = {}
        for pre, kc, vc in zip(pres, k_all, v_all, strict=True):
            caches[f"{pre}k_cache_out"], caches[f"{pre}v_cache_out"] = kc, vc
        return {"y": y, **caches}

    def inputs():
        out = {"x": _activations(rng, (batch, d_model))}
        for n in caches:
            out[n] = _activations(rng, (cache_len, d_model))
        return out

    return Workload(g.name, g.validate(), inputs, reference,
                    {"d_model": d_model, "heads": heads, "d_ff": d_ff,
                     "cache_len": cache_len, "batch": batch, "seed": seed})


def run_decoder(steps, *, d_model=64, heads=4, d_ff=128, seed=0, use_reference=False):
    """Decode ``steps`` tokens from an empty cache, one step graph per cache length.

    Each step ``t`` builds :func:`decoder_step` with ``cache_len=t`` and feeds it the caches the
    previous step produced (so the KV cache grows by one entry per step) and a token derived
    from ``seed`` and ``t``.

    Returns
    -------
    list of dict
        The outputs of every step (``y``, ``k_cache_out``, ``v_cache_out``).
    """
    _check_sizes(steps=steps)
    kc = np.zeros((0, d_model), dtype=np.int8)
    vc = kc
    rng = np.random.default_rng([seed, 1])
    results = []
    for t in range(steps):
        wl = decoder_step(d_model=d_model, heads=heads, d_ff=d_ff, cache_len=t, seed=seed)
        inputs = {"x": _activations(rng, (1, d_model)), "k_cache": kc, "v_cache": vc}
        out = wl.reference(inputs) if use_reference else wl.graph.evaluate(inputs)
        kc, vc = out["k_cache_out"], out["v_cache_out"]
        results.append(out)
    return results


# --- mixture of experts ------------------------------------------------------------------------

def moe(*, tokens=16, d_model=32, d_ff=64, experts=8, k=2, seed=0, name="moe"):
    """A mixture-of-experts layer with top-k gating.

    ``logits = x @ Wg``; each token goes to the ``k`` experts with the largest logits (ties to
    the lower expert index), with gate ``clip(logit >> s, 0, 127)``. Expert ``e`` gets the rows
    of the tokens routed to it (``dispatch``: a run-time number of rows) and computes
    ``relu(x_e @ W1_e) >> s1 -> int8 -> @ W2_e >> s2 -> int8``; ``combine`` adds
    ``(gate * y_e) >> 5`` into each token's int32 output row.

    Parameters
    ----------
    tokens, d_model, d_ff : int
        Tokens in the batch, model width, expert hidden width.
    experts, k : int
        Number of experts and experts per token (``1 <= k <= experts``).
    seed : int
        Seed of the weights and sample inputs.
    name : str
        Prefix of the graph name.
    """
    _check_sizes(tokens=tokens, d_model=d_model, d_ff=d_ff, experts=experts, k=k)
    if k > experts:
        raise ValueError(f"k must be at most experts ({experts}), not {k!r}")
    rng = np.random.default_rng(seed)
    wg = _weights(rng, (d_model, experts))
    w1 = [_weights(rng, (d_model, d_ff)) for _ in range(experts)]
    w2 = [_weights(rng, (d_ff, d_model)) for _ in range(experts)]
    s_gate, s1, s2, s_out = _shift_for(d_model), _shift_for(d_model), _shift_for(d_ff), 5
    g = DataflowGraph(f"{name}_t{tokens}_d{d_model}_f{d_ff}_e{experts}_k{k}")
    x = g.input("x", (tokens, d_model), "int8")
    logits = g.add("matmul", x, g.const("wg", wg), name="gate_logits")
    idx = g.add("topk", logits, name="gate_topk", k=k)
    gate = g.add("clip", g.add("shr", g.add("take", logits, idx, name="gate_take"),
                               name="gate_shr", shift=s_gate),
                 name="gate", lo=0, hi=127, dtype="int8")
    ys = []
    for e in range(experts):
        xe = g.add("dispatch", x, idx, name=f"e{e}_in", expert=e, experts=experts)
        h = g.add("relu", g.add("matmul", xe, g.const(f"e{e}_w1", w1[e]), name=f"e{e}_fc1"),
                  name=f"e{e}_relu")
        h = _requant(g, h, s1, f"e{e}_act")
        ys.append(_requant(g, g.add("matmul", h, g.const(f"e{e}_w2", w2[e]), name=f"e{e}_fc2"),
                           s2, f"e{e}_out"))
    out = g.add("combine", idx, gate, *ys, name="combine", shift=s_out)
    g.output("y", out)

    def reference(inputs):
        # A direct loop over tokens: route, run each chosen expert on the token, accumulate.
        xv = inputs["x"]
        y = np.zeros((tokens, d_model), dtype=np.int32)
        for t in range(tokens):
            row = _mm(xv[t:t + 1], wg)[0]
            chosen = sorted(range(experts), key=lambda e: (-int(row[e]), e))[:k]
            for e in chosen:
                gt = np.int64(min(max(int(row[e]) >> s_gate, 0), 127))
                h = _rq(np.maximum(_mm(xv[t:t + 1], w1[e]), 0), s1)
                ye = _rq(_mm(h, w2[e]), s2)[0]
                term = (gt * ye.astype(np.int64)).astype(np.int32) >> s_out
                y[t] = (y[t].astype(np.int64) + term).astype(np.int32)
        return {"y": y}

    return Workload(g.name, g.validate(), lambda: {"x": _activations(rng, (tokens, d_model))},
                    reference, {"tokens": tokens, "d_model": d_model, "d_ff": d_ff,
                                "experts": experts, "k": k, "seed": seed})


def switch(*, tokens=16, d_model=32, d_ff=64, experts=8, seed=0):
    """Switch-Transformer-like MoE: top-1 routing."""
    return moe(tokens=tokens, d_model=d_model, d_ff=d_ff, experts=experts, k=1, seed=seed,
               name="switch")


def mixtral(*, tokens=16, d_model=32, d_ff=64, seed=0):
    """Mixtral-like MoE: 8 experts, top-2 routing."""
    return moe(tokens=tokens, d_model=d_model, d_ff=d_ff, experts=8, k=2, seed=seed,
               name="mixtral")


#: Workload builders by name.
WORKLOADS = {"mlp": mlp, "decoder": decoder_step, "moe": moe, "switch": switch,
             "mixtral": mixtral}


def build(name, **options):
    """Build the workload called ``name`` with ``options``.

    Raises
    ------
    ValueError
        If there is no workload of that name.
    """
    if name not in WORKLOADS:
        raise ValueError(f"Workload must be one of {', '.join(sorted(WORKLOADS))}, "
                         f"not {name!r}")
    return WORKLOADS[name](**options)


def load_graph(path):
    """Load a user's dataflow graph from a Python file.

    The file is run as a script; it must define ``build()`` returning a
    :class:`~rdakit.compiler.graph.DataflowGraph` (or a :class:`Workload`), or a module-level
    ``graph``. The graph is validated before it is returned. A ``.pt2`` file (a saved
    ``torch.export`` program) is imported instead
    (:func:`rdakit.compiler.frontend.importer.import_program`, which needs torch).

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    GraphError
        If the file defines neither, or defines something else, or the graph is invalid.
    ModelImportError
        If a ``.pt2`` file cannot be imported (a :class:`~rdakit.errors.UserError`).
    """
    path = pathlib.Path(path)
    if path.suffix.lower() == ".pt2":
        # deferred: the front end is only for models (and needs torch only then)
        from rdakit.compiler.frontend.importer import load_workload as load_program_workload

        return load_program_workload(path).graph
    if not path.is_file():
        raise FileNotFoundError(f"Graph file {str(path)!r} does not exist")
    namespace = runpy.run_path(str(path), run_name="rdakit_user_graph")
    if callable(namespace.get("build")):
        graph = namespace["build"]()
    elif "graph" in namespace:
        graph = namespace["graph"]
    else:
        raise GraphError(f"Graph file {str(path)!r} must define build() or graph")
    if isinstance(graph, Workload):
        graph = graph.graph
    if not isinstance(graph, DataflowGraph):
        raise GraphError(f"Graph file {str(path)!r} must provide a DataflowGraph, not "
                         f"{type(graph).__name__}")
    return graph.validate()
