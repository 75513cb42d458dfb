"""``rdakit bench boards``: the largest fabric each board holds, with utilization and Fmax.

For each board: build the grids in order with the board's preset until one does not fit; then,
on the largest grid that fits, build larger MUs until one does not fit. Every build is a row
(utilization of each resource nextpnr counts, Fmax, the clock it was built for, build time).
"""

from rdakit.boards.build import RESOURCE_NAMES, board_spec, build
from rdakit.sim.bench.report import Report

__all__ = ["bench_boards"]


def _row(board, params, result):
    spec = board_spec(board)
    row = {"board": board, "grid": f"{params.rows}x{params.cols}", "lanes": params.cu.lanes,
           "mu_words": params.mu.words, "fits": result.fits}
    for bel in RESOURCE_NAMES[spec.family]:
        if bel in ("SB_IO", "TRELLIS_IO"):
            continue
        used, avail = result.utilization.get(bel, (None, None))
        row[bel] = f"{used}/{avail}" if used is not None else None
    row["fmax_mhz"] = round(result.fmax_mhz, 1) if result.fmax_mhz else None
    row["clock_mhz"] = result.clock_mhz
    row["seconds"] = round(result.seconds)
    row["problem"] = result.problem
    return row


def bench_boards(boards, *, grids, params_for, mu_words=None, root, json_path=None):
    """Build ``grids`` (``(rows, cols)`` in order) on each of ``boards`` until one does not
    fit, then larger MUs on the largest that fits (``mu_words``, default twice and four times
    its own), under ``root``. ``params_for(board, grid, **changes)`` gives the
    :class:`FabricParams` of a build (the board's preset and the options given). Prints the
    tables, writes the figures to ``json_path`` if given; returns the exit status."""
    report = Report("boards")
    for board in boards:
        spec = board_spec(board)
        rows, largest = [], None

        def one(params, tag, board=board, rows=rows):
            result = build(board, params, build_dir=root / f"{board}-{tag}",
                           log=lambda s: print(f"rdakit: {s}", flush=True))
            rows.append(_row(board, params, result))
            print(f"rdakit: {board} {tag}: "
                  f"{'fits' if result.fits else result.problem}, Fmax {result.fmax_mhz} MHz, "
                  f"{result.seconds:.0f} s", flush=True)
            return result

        for r, c in grids:
            params = params_for(board, (r, c))
            result = one(params, f"{r}x{c}")
            if not result.fits:
                break
            largest = (params, result)
        if largest is not None:
            params, result = largest
            sizes = mu_words or [params.mu.words * 2, params.mu.words * 4]
            for words in sizes:
                if words <= params.mu.words:
                    continue
                bigger = params_for(board, (params.rows, params.cols), mu_words=words)
                res = one(bigger, f"{params.rows}x{params.cols}-mu{words}")
                if not res.fits:
                    break
                largest = (bigger, res)
        report.table(f"{spec.title}: builds", rows, key=f"{board}_builds")
        if largest is None:
            report.figure(f"{board}.largest_grid", None)
        else:
            params, result = largest
            report.figure(f"{board}.largest_grid", f"{params.rows}x{params.cols}")
            report.figure(f"{board}.largest_mu_words", params.mu.words)
            report.figure(f"{board}.fmax_mhz", result.fmax_mhz)
            report.figure(f"{board}.meets_clock", result.meets_clock)
    report.finish(json_path)
    return 0
