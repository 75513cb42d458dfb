"""``rdakit bench e2e``: the workloads on the RTL fabric with every partitioner and every
memory scheme, cycles beside the cost model's lower bound.

Two tables (their keys in the report JSON):

* ``partitioners``: MLP, decoder with KV cache and MoE on one fabric (one Verilog build), each
  compiled by every partitioner (the seed's baselines round-robin and static, HEFT, and the
  graph partitioners), with the measured cycles, the cost model's lower bound
  (:func:`~rdakit.sim.flows.e2e.compute_bound`), CU utilization, NoC flits and MU peak memory;
* ``memory_schemes``: the same workloads compiled by the default partitioner on three fabrics that
  differ only in the MU's memory scheme: weighted reference counting with partial free and
  virtualization (the default), counter-based reference counting, and reserve-and-copy
  allocation.

Every run is checked bit for bit against numpy and the interpreter; a failed run is reported
in the ``check`` column and makes the command exit 1.
"""

from rdakit.compiler.partition.external import mtkahypar_missing
from rdakit.sim.bench.partition import PARTITIONERS
from rdakit.sim.flows.e2e import SMALLEST, RunSpec, failure, run_many

__all__ = ["WORKLOADS", "MEMORY_SCHEMES", "specs", "run"]

#: The workloads of the benchmark (the issue's MLP, decoder-with-KV-cache and MoE).
WORKLOADS = ("mlp", "decoder", "moe")

#: name -> the fabric parameters that differ from the default.
MEMORY_SCHEMES = {
    "weighted+virtual": {},
    "counter+virtual": {"refcount": "counter"},
    "weighted+reserve": {"alloc_mode": "reserve"},
}


def partitioners():
    """The partitioners the benchmark compares (Mt-KaHyPar only when it is installed)."""
    return [p for p in PARTITIONERS if not (p == "mtkahypar" and mtkahypar_missing())]


def specs(fabric, *, workloads=WORKLOADS, names=None, place_steps=20000):
    """``{group: [RunSpec, ...]}``: the runs of each simulation (one build per group)."""
    names = names or partitioners()
    groups = {"partitioners": [RunSpec(w, SMALLEST[w], fabric, partitioner=p,
                                       place_steps=place_steps)
                               for w in workloads for p in names]}
    for scheme, extra in MEMORY_SCHEMES.items():
        if extra:
            groups[scheme] = [RunSpec(w, SMALLEST[w], {**fabric, **extra},
                                      place_steps=place_steps) for w in workloads]
    return groups


def _row(spec, rows, scheme=None):
    r = rows[-1]
    out = {"workload": spec.workload}
    if scheme:
        out["scheme"] = scheme
    else:
        out["partitioner"] = spec.partitioner
    check = next((why for why in map(failure, rows) if why), "ok")
    out.update({k: r.get(k) for k in ("cycles", "lower_bound", "lanes_bound", "mu_bound",
                                      "cycles_over_bound", "estimated_cycles", "utilization",
                                      "noc_flits", "mu_peak_words", "allocs", "frees", "parts",
                                      "cut")})
    out["check"] = check
    return out


def run(fabric, *, sim, workloads=WORKLOADS, names=None, place_steps=20000, progress=None,
        build=None):
    """Run every group; return ``(partitioner_rows, memory_rows)``. ``build``: how Verilator
    builds the fabrics (:func:`~rdakit.sim.flows.e2e.run_many`)."""
    groups = specs(fabric, workloads=workloads, names=names, place_steps=place_steps)
    part_rows, mem_rows = [], []
    for group, runs in groups.items():
        results = run_many(runs, sim=sim, build=build, progress=(
            None if progress is None else
            lambda stage, done=None, total=None, g=group: progress(f"{g}: {stage}", done, total)))
        for spec, rows in zip(runs, results, strict=True):
            if group == "partitioners":
                part_rows.append(_row(spec, rows))
                if spec.partitioner == "multilevel":
                    mem_rows.append(_row(spec, rows, scheme="weighted+virtual"))
            else:
                mem_rows.append(_row(spec, rows, scheme=group))
    # Relative to the seed's baseline on the same workload.
    base = {r["workload"]: r["cycles"] for r in part_rows if r["partitioner"] == "round_robin"}
    for r in part_rows:
        b = base.get(r["workload"])
        r["vs_round_robin"] = round(r["cycles"] / b, 3) if r["cycles"] and b else None
    order = list(MEMORY_SCHEMES)
    mem_rows.sort(key=lambda r: (workloads.index(r["workload"]), order.index(r["scheme"])))
    return part_rows, mem_rows
