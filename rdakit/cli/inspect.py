"""``rdakit inspect`` (a bitstream's listing) and ``rdakit verilog fabric``."""

import pathlib

from rdakit.cli.options import add_fabric_arguments, fabric_from_args

__all__ = ["register"]


def _inspect(args):
    from rdakit.errors import UserError
    from rdakit.hdl.spec.bitstream import BitstreamError, listing, read_bitstream

    params = fabric_from_args(args)
    try:
        data = pathlib.Path(args.file).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {args.file}: {e.strerror}") from None
    try:
        config = read_bitstream(data, params)
    except BitstreamError as e:
        raise UserError(f"{args.file}: {e}") from None
    print(listing(config))
    return 0


def _verilog_fabric(args):
    from rdakit.cli.verilog import write_verilog
    from rdakit.errors import UserError
    from rdakit.hdl.fabric.top import Fabric

    params = fabric_from_args(args)
    try:
        fabric = Fabric(params)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    return write_verilog(args, fabric, f"{params.rows}x{params.cols} fabric")


def register(commands, verilog, bench):
    p = commands.add_parser(
        "inspect", help="list a bitstream: tiles, programs disassembled, registers",
        description="Check a bitstream against a fabric's parameters and print a readable "
                    "listing; a malformed bitstream is rejected with the reason.")
    p.add_argument("file", help="the bitstream (.bit)")
    add_fabric_arguments(p)
    p.set_defaults(func=_inspect)

    p = verilog.add_parser("fabric", help="a whole fabric",
                           description="Write the Verilog of an R x C fabric with its host "
                                       "port (docs/fabric.md).")
    add_fabric_arguments(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE")
    p.add_argument("--name", default="top", help="top module name (default: %(default)s)")
    p.set_defaults(func=_verilog_fabric)
