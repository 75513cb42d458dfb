"""``--fabric auto`` chooses the program length too: with ``--prog-len`` left out, a workload
whose programs are too long for every fabric at the command's length gets the next power of
two that holds them (only where the programs were what did not fit), and says so; a length the
user gives is kept. Cheap: a small MLP with a tiny default program length."""

import argparse

import pytest

from rdakit.cli import compile as compile_cli
from rdakit.cli import inspect as inspect_cli
from rdakit.cli import main
from rdakit.cli.compile import choose_fabric
from rdakit.cli.options import RUN_PROG_LEN, add_fabric_arguments, fabric_candidates
from rdakit.compiler.compile import bitstream_for, compile_workload, load_workload
from rdakit.errors import UserError
from rdakit.hdl.spec.params import fabric_params

MLP = ["--size", "batch=2", "--size", "sizes=8,16,8"]


def fabric_args(argv, prog_len=32):
    """The fabric options of a command whose default program length is ``prog_len``."""
    parser = argparse.ArgumentParser()
    add_fabric_arguments(parser, auto=True, check=False)
    parser.set_defaults(prog_len=prog_len)
    return parser.parse_args(argv)


def choose(workload, argv, prog_len=32):
    return choose_fabric(workload, fabric_candidates(fabric_args(argv, prog_len)),
                         name="mlp", partitioner="multilevel", seed=0, place_steps=200)


@pytest.fixture(scope="module")
def mlp():
    """The built-in MLP at its default sizes: 4096-word MUs on 2x2, programs of 44
    instructions."""
    return load_workload("mlp")


def test_candidates_double_the_program_length_only_when_it_is_left_out():
    lengths = {kw["prog_len"] for kw in fabric_candidates(fabric_args([]))}
    assert lengths == {32, 64, 128, 256, 512, 1024, 2048, 4096}     # fabric_params' largest
    assert {kw["prog_len"] for kw in fabric_candidates(fabric_args(["--prog-len", "32"]))} \
        == {32}
    exact = fabric_args(["--fabric", "2x2", "--mu-words", "1024"])
    assert [kw["prog_len"] for kw in fabric_candidates(exact)] == [32]


def test_auto_takes_the_next_program_length_where_programs_were_too_long(mlp, monkeypatch):
    tried = []

    def compile_workload_(workload, *, params, **kw):
        tried.append((params.mu.words, params.cu.prog_len))
        return compile_workload(workload, params=params, **kw)

    monkeypatch.setattr(compile_cli, "compile_workload", compile_workload_)
    kw, said = choose(mlp, ["--fabric", "2x2"])
    assert (kw["rows"], kw["cols"], kw["mu_words"], kw["prog_len"]) == (2, 2, 4096, 64)
    assert said == ("fabric 2x2 with 4096-word MUs and prog_len 64: the smallest that fits "
                    "mlp_b4_64x128x64 (one CU's program is 48 instructions, more than prog_len "
                    "32; --fabric 2x2 --mu-words 4096 --prog-len 64 gives the same)")
    # 1024 and 2048 words do not hold its buffers whatever the program length: not tried again.
    assert tried == [(1024, 32), (2048, 32), (4096, 32), (8192, 32), (16384, 32), (32768, 32),
                     (65536, 32), (4096, 64)]


def test_a_program_length_the_user_gives_is_kept(mlp):
    with pytest.raises(UserError) as e:
        choose(mlp, ["--fabric", "2x2", "--prog-len", "32"])
    assert str(e.value) == (
        "mlp does not fit the 2x2 fabric with MUs of 1024 to 65536 words; on 2x2 with "
        "65536-word MUs: The program of CU (1, 1) (2 ops: 'fc0', 'bias0') is 48 instructions "
        "long but prog_len is 32 (a larger --prog-len, fabric or another partitioner may fit)")


def test_the_command_line_keeps_a_given_program_length(capsys):
    assert main(["compile", "mlp", *MLP, "--fabric", "2x2", "--prog-len", "32",
                 "--place-steps", "200"]) == 2
    assert capsys.readouterr().err == (
        "rdakit: error: mlp does not fit the 2x2 fabric with MUs of 1024 to 65536 words; on "
        "2x2 with 65536-word MUs: The program of CU (1, 1) (2 ops: 'fc0', 'bias0') is 48 "
        "instructions long but prog_len is 32 (a larger --prog-len, fabric or another "
        "partitioner may fit)\n")


def test_inspect_finds_a_bitstream_with_the_chosen_program_length(mlp):
    kw, _ = choose(mlp, ["--fabric", "2x2"], prog_len=RUN_PROG_LEN // 64)
    job, _ = compile_workload(mlp, params=fabric_params(**kw), place_steps=200)
    args = fabric_args(["--fabric", "2x2"], prog_len=RUN_PROG_LEN // 64)
    assert inspect_cli._params_of(bitstream_for(job), args) == fabric_params(**kw)


def test_nothing_fits_names_the_program_lengths_tried(mlp):
    # Programs of 48 instructions, lengths 16 and 32 only: the 32 is not compiled (48 > 32).
    candidates = [kw for kw in fabric_candidates(fabric_args(["--fabric", "2x2"], prog_len=16))
                  if kw["prog_len"] <= 32]
    with pytest.raises(UserError) as e:
        choose_fabric(mlp, candidates, name="mlp", partitioner="multilevel", seed=0,
                      place_steps=200)
    assert str(e.value) == (
        "mlp does not fit the 2x2 fabric with MUs of 1024 to 65536 words and programs of 16 to "
        "32 instructions; on 2x2 with 65536-word MUs: The program of CU (1, 1) (2 ops: 'fc0', "
        "'bias0') is 48 instructions long but prog_len is 16 (a larger --prog-len, fabric or "
        "another partitioner may fit)")
