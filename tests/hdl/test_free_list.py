# amaranth: UnusedElaboratable=no
"""The free list on its own, cycle by cycle against a Python list."""

import random

import pytest

from rdakit.hdl.memory.free_list import FreeList
from rdakit.sim.verify.amaranth_sim import WithReset, simulate
from rdakit.sim.verify.runner import generate_verilog


class FreeListModel:
    """Most recently pushed first, then entries never taken in increasing order."""

    def __init__(self, depth, fresh=True):
        self.depth = depth
        self.stack = []
        self.taken = 0 if fresh else depth

    @property
    def count(self):
        return len(self.stack) + self.depth - self.taken

    @property
    def empty(self):
        return self.count == 0

    @property
    def head(self):
        return self.stack[-1] if self.stack else self.taken

    def step(self, pop, push, data):
        out = None
        if pop:
            out = self.head
            if self.stack:
                self.stack.pop()
            else:
                self.taken += 1
        if push:
            self.stack.append(data)
        return out


def run_random(depth, *, fresh, steps, seed):
    fl = FreeList(depth, fresh=fresh)
    model = FreeListModel(depth, fresh)
    rng = random.Random(seed)
    # Entries outside the list, which may be pushed back.
    outside = [] if fresh else list(range(depth))

    async def tb(ctx):
        for step in range(steps):
            assert ctx.get(fl.count) == model.count, f"step {step}"
            assert ctx.get(fl.empty) == model.empty, f"step {step}"
            if not model.empty:
                assert ctx.get(fl.head) == model.head, f"step {step}"
            pop = not model.empty and rng.random() < 0.5
            push = bool(outside) and rng.random() < 0.5
            data = outside.pop(rng.randrange(len(outside))) if push else 0
            ctx.set(fl.pop, pop)
            ctx.set(fl.push, push)
            ctx.set(fl.push_data, data)
            popped = model.step(pop, push, data)
            if pop:
                outside.append(popped)
            await ctx.tick()
        ctx.set(fl.pop, 0)
        ctx.set(fl.push, 0)

    simulate(fl, tb)
    return model


@pytest.mark.parametrize("depth", [1, 2, 5, 16])
@pytest.mark.parametrize("fresh", [True, False])
def test_random_push_pop_matches_model(depth, fresh):
    run_random(depth, fresh=fresh, steps=600, seed=depth)


def test_hands_out_fresh_entries_in_order_then_most_recently_freed_first():
    fl = FreeList(8)

    async def tb(ctx):
        got = []
        for _ in range(3):
            got.append(ctx.get(fl.head))
            ctx.set(fl.pop, 1)
            await ctx.tick()
        ctx.set(fl.pop, 0)
        assert got == [0, 1, 2]
        for v in (1, 0):
            ctx.set(fl.push, 1)
            ctx.set(fl.push_data, v)
            await ctx.tick()
        ctx.set(fl.push, 0)
        assert ctx.get(fl.count) == 7
        assert ctx.get(fl.head) == 0       # the last one released
        ctx.set(fl.pop, 1)
        await ctx.tick()
        assert ctx.get(fl.head) == 1
        await ctx.tick()
        assert ctx.get(fl.head) == 3       # the stack is empty again: next fresh entry
        ctx.set(fl.pop, 0)

    simulate(fl, tb)


def test_pop_and_push_in_one_cycle():
    fl = FreeList(4)

    async def tb(ctx):
        ctx.set(fl.pop, 1)
        ctx.set(fl.push, 1)
        ctx.set(fl.push_data, 0)            # take 0 and give it straight back
        await ctx.tick()
        assert ctx.get(fl.count) == 4
        assert ctx.get(fl.head) == 0
        ctx.set(fl.push_data, 0)
        await ctx.tick()                    # take 0 (from the stack) and give 0 back again
        ctx.set(fl.pop, 0)
        ctx.set(fl.push, 0)
        assert ctx.get(fl.count) == 4
        assert ctx.get(fl.head) == 0

    simulate(fl, tb)


def test_run_time_reset_frees_everything():
    fl = FreeList(4)
    top = WithReset(fl)

    async def tb(ctx):
        ctx.set(fl.pop, 1)
        await ctx.tick().repeat(3)
        ctx.set(fl.pop, 0)
        assert ctx.get(fl.count) == 1
        ctx.set(top.rst, 1)
        await ctx.tick()
        ctx.set(top.rst, 0)
        assert ctx.get(fl.count) == 4
        assert ctx.get(fl.head) == 0

    simulate(top, tb)


def test_converts_to_verilog():
    for depth in (1, 3, 64):
        assert "module top" in generate_verilog(FreeList(depth))


@pytest.mark.parametrize("depth", [0, -1, 1.5, True])
def test_init_wrong_depth(depth):
    with pytest.raises(TypeError, match=r"^Depth must be a positive integer, not "):
        FreeList(depth)


def test_init_wrong_width():
    with pytest.raises(TypeError, match=r"^Width must be a positive integer that holds 15, "
                                        r"not 3$"):
        FreeList(16, width=3)
