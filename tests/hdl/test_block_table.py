# amaranth: UnusedElaboratable=no
"""The block table on its own: lookups, write forwarding, usable from the first cycle."""

import random

import pytest

from rdakit.hdl.memory.block_table import BlockTable
from rdakit.hdl.spec.params import MUParams
from rdakit.sim.verify.amaranth_sim import simulate
from rdakit.sim.verify.runner import generate_verilog

P = MUParams(words=256, block_words=16, max_buffers=4, buf_id_bits=4, max_buffer_words=128)


async def lookup(ctx, bt, slot, vblock):
    ctx.set(bt.lookup_en, 1)
    ctx.set(bt.lookup_slot, slot)
    ctx.set(bt.lookup_vblock, vblock)
    await ctx.tick()
    ctx.set(bt.lookup_en, 0)
    return ctx.get(bt.entry)


async def write(ctx, bt, slot, vblock, block):
    ctx.set(bt.write_en, 1)
    ctx.set(bt.write_slot, slot)
    ctx.set(bt.write_vblock, vblock)
    ctx.set(bt.write_block, block)
    await ctx.tick()
    ctx.set(bt.write_en, 0)


def test_maps_randomly_like_a_dict_from_the_first_cycle():
    # No clearing after reset (whether an entry is mapped is the buffer table's business): a
    # write in the very first cycle is kept.
    bt = BlockTable(P)
    rng = random.Random(3)

    async def tb(ctx):
        table = {}
        for _ in range(300):
            key = (rng.randrange(P.max_buffers), rng.randrange(P.max_vblocks))
            if rng.random() < 0.5 or key not in table:
                table[key] = rng.randrange(P.n_blocks)
                await write(ctx, bt, *key, table[key])
            else:
                assert await lookup(ctx, bt, *key) == table[key]

    simulate(bt, tb)


def test_write_and_lookup_of_one_entry_in_one_cycle_sees_the_new_entry():
    bt = BlockTable(P)

    async def tb(ctx):
        ctx.set(bt.write_en, 1)
        ctx.set(bt.write_slot, 2)
        ctx.set(bt.write_vblock, 5)
        ctx.set(bt.write_block, 9)
        assert await lookup(ctx, bt, 2, 5) == 9
        ctx.set(bt.write_en, 0)
        await ctx.tick()
        assert ctx.get(bt.entry) == 9        # held until the next lookup

    simulate(bt, tb)


def test_converts_to_verilog():
    assert "module top" in generate_verilog(BlockTable(P))


def test_init_wrong_params():
    with pytest.raises(TypeError, match=r"^Params must be an MUParams, not 3$"):
        BlockTable(3)
