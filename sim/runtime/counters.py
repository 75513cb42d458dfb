"""Tile counters: the one place that reads them over the host port and takes a run's share.

Every tile has the :data:`~rdakit.hdl.spec.config.TILE_COUNTERS`; a CU adds its profile
(:data:`~rdakit.hdl.spec.config.CU_PROFILE`, ``wait_cycles`` among them) and the fields of its
STATUS word (:func:`~rdakit.hdl.spec.config.decode_cu_status`), an MU its occupancy and
allocation counters (:class:`~rdakit.hdl.spec.config.MU_MAP`). They come back as
``{(x, y): {name: value}}`` (tiles as tuples; names as in the docs' report keys).

A CU's counters restart at START; an MU tile's count from reset, so the counters of one run are
the MU's readings after it minus those at START (:func:`run_delta`), except occupancy and peak,
which are kept as read.
"""

from rdakit.hdl.spec.config import CU_MAP, CU_PROFILE, MU_MAP, TILE_COUNTERS, decode_cu_status

__all__ = ["MU_COUNTERS", "MU_CUMULATIVE", "read_counters", "read_mu_counters", "run_delta"]

#: An MU tile's own counters (beyond :data:`TILE_COUNTERS`), by name.
MU_COUNTERS = {name.lower(): getattr(MU_MAP, name)
               for name in ("HELD_WORDS", "PEAK_HELD_WORDS", "LIVE_BUFFERS", "ALLOCS", "FREES",
                            "COPY_CYCLES", "FREE_BLOCKS")}

#: MU-tile counters that count from reset (the others are occupancy readings).
MU_CUMULATIVE = (*TILE_COUNTERS, "allocs", "frees", "copy_cycles")


async def read_counters(host):
    """Every tile's counters through ``host`` (a
    :class:`~rdakit.sim.runtime.host.HostDriver`): ``{(x, y): {name: value}}``."""
    out = {}
    for x, y in host.params.tiles():
        c = {name: await host.cfg_read(x, y, addr) for name, addr in TILE_COUNTERS.items()}
        if host.params.kind(x, y) == "M":
            for name, addr in MU_COUNTERS.items():
                c[name] = await host.cfg_read(x, y, addr)
        else:
            for name, addr in CU_PROFILE.items():
                c[name] = await host.cfg_read(x, y, addr)
            c.update(decode_cu_status(await host.cfg_read(x, y, CU_MAP.STATUS)))
        out[(x, y)] = c
    return out


async def read_mu_counters(host, names):
    """The MU counters ``names`` (keys of :data:`MU_COUNTERS`) of every MU tile:
    ``{(x, y): {name: value}}`` (fewer reads than :func:`read_counters`)."""
    for name in names:
        if name not in MU_COUNTERS:
            raise ValueError(f"MU counter must be one of {', '.join(MU_COUNTERS)}, not {name!r}")
    return {(x, y): {name: await host.cfg_read(x, y, MU_COUNTERS[name]) for name in names}
            for x, y in host.params.tiles("M")}


def run_delta(params, before, after):
    """The counters of one run from readings ``before`` (at START) and ``after`` it: a CU's as
    read after (they restart at START); an MU tile's :data:`MU_CUMULATIVE` counters minus
    their value before, its occupancy and peak as read after."""
    out = {}
    for xy, c in after.items():
        if params.kind(*xy) == "C":
            out[xy] = c
        else:
            out[xy] = {k: v - before[xy][k] if k in MU_CUMULATIVE else v for k, v in c.items()}
    return out
