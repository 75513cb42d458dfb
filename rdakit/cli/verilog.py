"""``rdakit verilog mu``: Verilog of the memory unit, with every parameter as an option."""

import dataclasses
import enum
import pathlib

from rdakit.hdl.spec.params import PLASTICINE_MU, MUParams

__all__ = ["register", "add_params_arguments", "params_from_args", "write_verilog"]

PRESETS = {"default": MUParams(), "plasticine": PLASTICINE_MU}


def add_params_arguments(parser, cls=MUParams, *, presets=PRESETS):
    """Add one ``--option`` per field of the parameter dataclass ``cls`` (and ``--preset``)."""
    group = parser.add_argument_group(f"{cls.__name__} parameters (see docs/memory-unit.md)")
    if presets:
        group.add_argument("--preset", choices=sorted(presets), default="default",
                           help="start from a named parameter set (default: %(default)s)")
    for field in dataclasses.fields(cls):
        default = field.default
        kind = type(default) if default is not None else int
        if isinstance(default, enum.Enum):
            choices = [m.value for m in type(default)]
            group.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name,
                               choices=choices, default=None,
                               help=f"default: {default.value}")
        else:
            group.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, type=kind,
                               default=None, metavar="N",
                               help=f"default: {'derived' if default is None else default}")


def params_from_args(args, cls=MUParams, *, presets=PRESETS):
    """Build the parameter set from parsed arguments, or raise UserError naming the problem."""
    from rdakit.errors import UserError

    base = presets[args.preset] if presets else cls()
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
               if getattr(args, f.name, None) is not None}
    try:
        return base.replace(**changes)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None


def _verilog_mu(args):
    from rdakit.errors import UserError
    from rdakit.hdl.memory.unit import MemoryUnit

    params = params_from_args(args)
    try:
        mu = MemoryUnit(params, mu_id=args.mu_id)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    return write_verilog(args, mu, f"{params.alloc_mode.value}, {params.refcount.value}, "
                                   f"{params.words} words")


def write_verilog(args, component, what):
    """Write ``component``'s Verilog to ``args.output`` (``-``: standard output) as module
    ``args.name``, headed by the Verilator lint waivers with their reasons."""
    from rdakit.sim.verify.runner import generate_verilog, lint_waiver_header

    text = lint_waiver_header() + generate_verilog(component, name=args.name)
    if args.output == "-":
        print(text, end="")
    else:
        path = pathlib.Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}: module {args.name}, {len(text.splitlines())} lines ({what})")
    return 0


def add_output_arguments(parser, default_name="top"):
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="Verilog file to write ('-' for standard output)")
    parser.add_argument("--name", default=default_name,
                        help="name of the top module (default: %(default)s)")


def register(commands, verilog, bench):
    p = verilog.add_parser(
        "mu", help="the memory unit",
        description="Write the Verilog of a memory unit (ports: clk, rst, req__*, resp__*, "
                    "counters; see docs/memory-unit.md).")
    add_params_arguments(p)
    p.add_argument("--mu-id", type=int, default=0, help="this MU's ID (default: 0)")
    add_output_arguments(p)
    p.set_defaults(func=_verilog_mu)
