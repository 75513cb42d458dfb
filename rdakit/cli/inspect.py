"""``rdakit inspect``: a bitstream checked against a fabric's parameters, listed readably."""

import pathlib

from rdakit.cli.options import add_fabric_arguments, fabric_from_args
from rdakit.errors import UserError
from rdakit.hdl.spec.bitstream import BitstreamError, listing, read_bitstream

__all__ = ["register"]


def _inspect(args):
    params = fabric_from_args(args)
    try:
        data = pathlib.Path(args.file).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {args.file}: {e.strerror}") from None
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
                    "listing; a malformed bitstream is rejected with the reason.")
    p.add_argument("file", help="the bitstream (.bit)")
    add_fabric_arguments(p)
    p.set_defaults(func=_inspect)
