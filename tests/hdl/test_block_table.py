# amaranth: UnusedElaboratable=no
"""The block table on its own: clearing after reset, lookups, write forwarding."""

import random

import pytest

from rdakit.hdl.memory.block_table import BlockTable
from rdakit.hdl.spec.params import MUParams
from rdakit.sim.verify.amaranth_sim import WithReset, simulate
from rdakit.sim.verify.runner import generate_verilog

P = MUParams(words=256, block_words=16, max_buffers=4, buf_id_bits=4, max_buffer_words=128)


async def wait_ready(ctx, bt):
    cycles = 0
    while not ctx.get(bt.ready):
        await ctx.tick()
        cycles += 1
    return cycles


async def lookup(ctx, bt, slot, vblock):
    ctx.set(bt.lookup_en, 1)
    ctx.set(bt.lookup_slot, slot)
    ctx.set(bt.lookup_vblock, vblock)
    await ctx.tick()
    ctx.set(bt.lookup_en, 0)
    return ctx.get(bt.entry.valid), ctx.get(bt.entry.block)


async def write(ctx, bt, slot, vblock, valid, block):
    ctx.set(bt.write_en, 1)
    ctx.set(bt.write_slot, slot)
    ctx.set(bt.write_vblock, vblock)
    ctx.set(bt.write_entry.valid, valid)
    ctx.set(bt.write_entry.block, block)
    await ctx.tick()
    ctx.set(bt.write_en, 0)


def test_clears_every_entry_after_reset_and_maps_randomly_like_a_dict():
    bt = BlockTable(P)
    top = WithReset(bt)
    rng = random.Random(3)

    async def tb(ctx):
        for _round in range(2):
            cycles = await wait_ready(ctx, bt)
            assert cycles == P.max_buffers * P.max_vblocks
            for slot in range(P.max_buffers):
                for vb in range(P.max_vblocks):
                    assert await lookup(ctx, bt, slot, vb) == (0, 0)
            table = {}
            for _ in range(200):
                key = (rng.randrange(P.max_buffers), rng.randrange(P.max_vblocks))
                if rng.random() < 0.5:
                    value = (rng.randrange(2), rng.randrange(P.n_blocks))
                    table[key] = value
                    await write(ctx, bt, *key, *value)
                else:
                    assert await lookup(ctx, bt, *key) == table.get(key, (0, 0))
            # Reset in the middle of use: everything is invalid again afterwards.
            ctx.set(top.rst, 1)
            await ctx.tick()
            ctx.set(top.rst, 0)

    simulate(top, tb)


def test_write_and_lookup_of_one_entry_in_one_cycle_sees_the_new_entry():
    bt = BlockTable(P)

    async def tb(ctx):
        await wait_ready(ctx, bt)
        ctx.set(bt.write_en, 1)
        ctx.set(bt.write_slot, 2)
        ctx.set(bt.write_vblock, 5)
        ctx.set(bt.write_entry.valid, 1)
        ctx.set(bt.write_entry.block, 9)
        assert await lookup(ctx, bt, 2, 5) == (1, 9)
        ctx.set(bt.write_en, 0)
        await ctx.tick()
        assert (ctx.get(bt.entry.valid), ctx.get(bt.entry.block)) == (1, 9)  # held

    simulate(bt, tb)


def test_writes_are_ignored_while_clearing():
    bt = BlockTable(P)

    async def tb(ctx):
        await write(ctx, bt, 0, 0, 1, 7)     # during the clear: dropped
        await wait_ready(ctx, bt)
        assert await lookup(ctx, bt, 0, 0) == (0, 0)

    simulate(bt, tb)


def test_converts_to_verilog():
    assert "module top" in generate_verilog(BlockTable(P))


def test_init_wrong_params():
    with pytest.raises(TypeError, match=r"^Params must be an MUParams, not 3$"):
        BlockTable(3)
