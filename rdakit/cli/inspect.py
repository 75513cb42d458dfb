"""``rdakit inspect``: a bitstream checked against a fabric's parameters, listed readably."""

import inspect
import pathlib

from rdakit.cli.options import (
    AUTO,
    RUN_PROG_LEN,
    add_fabric_arguments,
    fabric_candidates,
)
from rdakit.errors import UserError
from rdakit.hdl.spec.bitstream import (
    HEADER,
    BitstreamError,
    listing,
    params_hash,
    read_bitstream,
)
from rdakit.hdl.spec.params import fabric_params

__all__ = ["register"]


#: The program length of a fabric built without --prog-len (rdakit verilog fabric's).
_FABRIC_PROG_LEN = inspect.signature(fabric_params).parameters["prog_len"].default


def _params_of(data, args):
    """The fabric to check the bitstream against: of the fabrics the options allow (with
    ``--fabric auto`` or ``--mu-words`` left out, those of ``rdakit compile``'s search; with
    ``--prog-len`` at its default, also a fabric's own default program length), the one
    whose parameter hash the bitstream's header holds, or the first if none does (the reader
    then says why the bitstream does not load)."""
    searched = fabric_candidates(args)        # with the longer programs compile may choose
    candidates = [fabric_params(**kw) for kw in searched]
    if args.prog_len == RUN_PROG_LEN:
        candidates += [fabric_params(**{**kw, "prog_len": _FABRIC_PROG_LEN}) for kw in searched
                       if kw["prog_len"] == args.prog_len]
    if len(data) >= HEADER.size:
        phash = HEADER.unpack_from(data)[3]
        for params in candidates:
            if params_hash(params) == phash:
                return params
    return candidates[0]


def _inspect(args):
    try:
        data = pathlib.Path(args.file).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {args.file}: {e.strerror}") from None
    params = _params_of(data, args)
    try:
        config = read_bitstream(data, params)
    except BitstreamError as e:
        # The status is what the fabric's LOAD_STATUS would say for the same file.
        said = f" (the fabric's loader refuses it: {e.status.name})" \
            if e.status is not None else ""
        raise UserError(f"{args.file}: {e}{said}") from None
    print(listing(config))
    return 0


def register(commands):
    p = commands.add_parser(
        "inspect", help="list a bitstream: tiles, programs disassembled, registers",
        description="Check a bitstream against a fabric's parameters and print a readable "
                    "listing; a malformed bitstream is rejected with the reason. With "
                    f"--fabric {AUTO} (the default) and --mu-words left out, the fabric is "
                    "the one of rdakit compile's search whose parameters the bitstream was "
                    f"built for; CU program length defaults to {RUN_PROG_LEN}, as in rdakit "
                    f"compile (or a fabric's own {_FABRIC_PROG_LEN}, if the bitstream was "
                    f"built for it).")
    p.add_argument("file", help="the bitstream (.bit)")
    add_fabric_arguments(p, auto=True)
    p.set_defaults(func=_inspect, prog_len=RUN_PROG_LEN)
