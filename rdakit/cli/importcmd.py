"""``rdakit import``: a saved torch.export program (``.pt2``) as an integer IR graph file."""

import json
import os

from rdakit.cli.options import add_check, add_number
from rdakit.cli.outputs import add_input, add_output
from rdakit.errors import UserError
from rdakit.files import atomic_write

__all__ = ["register"]


def _check(args):
    """The program file and the constants file beside the output, before any work."""
    # deferred: the importer (and torch, which it loads only for a program) are for this command
    from rdakit.compiler.frontend.graphfile import constants_path
    from rdakit.compiler.frontend.importer import check_program_file, require_torch

    check_program_file(args.program)
    require_torch(repr(args.program))
    if args.output:
        npz = constants_path(args.output)
        if npz.is_dir():
            raise UserError(f"--output {args.output!r}: its constants go to {str(npz)!r}, "
                            f"which is a folder")
        if npz.exists() and os.path.samefile(npz, args.program):
            raise UserError(f"--output {args.output!r}: its constants would go to "
                            f"{str(npz)!r}, the input program: writing it would destroy it")


def _import(args):
    from rdakit.compiler.frontend.graphfile import write_graph_file
    from rdakit.compiler.frontend.importer import import_program

    model = import_program(args.program, seed=args.seed)
    for line in model.summary_lines():
        print(line)
    if args.output:
        scales = ", ".join(f"{k} {v:.6g}" for k, v in model.input_scales.items() if v)
        outs = ", ".join(f"{k} {v:.6g}" for k, v in model.output_scales.items())
        header = (f"{model.name}: the integer graph of the torch.export program "
                  f"{os.path.basename(args.program)}, written by rdakit import.\n\n"
                  f"Scales (real = scale * integer): inputs {scales or 'none'}; outputs "
                  f"{outs}.\nExample inputs: {model.example_source}.\n"
                  + "\n".join(model.accuracy.lines()))
        written = write_graph_file(model.graph, args.output, header=header)
        print(f"wrote {' and '.join(str(p) for p in written)} ({len(model.graph)} ops)")
    if args.json:
        data = {"program": args.program, "graph": model.name, "ops": len(model.graph),
                "example_inputs": model.example_source, "folded": model.folded,
                "input_scales": model.input_scales, "output_scales": model.output_scales,
                "accuracy": model.accuracy.as_dict(), "coverage": model.coverage}
        atomic_write(args.json, json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _json_suffix(args):
    return "a JSON", (".json",)


def register(commands):
    c = commands.add_parser(
        "import", help="import a torch.export program (.pt2) as an integer graph file",
        description="Import a program saved by torch.export.save: every aten op it uses must "
                    "be one the importer handles (all the others are listed at once, with "
                    "their counts). The program is quantized after training (int8 "
                    "activations calibrated on its example inputs, int8 weights per output "
                    "channel, int32 accumulators, integer requantization), and the accuracy "
                    "of the integer graph against the float program is printed. With -o, "
                    "the graph is written as a Python graph file that rdakit compile and "
                    "rdakit run accept (constants of more than 16 elements in a .npz beside "
                    "it). rdakit compile and run also take the .pt2 itself. Needs torch: "
                    "pip install 'rdakit[torch]'. docs/import.md.")
    c.add_argument("program", metavar="FILE.pt2", help="a program saved by torch.export.save")
    add_input(c, "program", "FILE.pt2")
    add_output(c, "-o", "--output", metavar="GRAPH.py", suffixes=lambda args: (
        "a Python", (".py",)), help="write the graph file (and GRAPH.npz beside it)")
    add_output(c, "--json", metavar="FILE", suffixes=_json_suffix,
               help="write the coverage, scales and accuracy as JSON")
    add_number(c, "--seed", low=0, high=(1 << 32) - 1, default=0,
               help="seed of the random example inputs of a program saved without any "
                    "(default 0)")
    add_check(c, _check)
    c.set_defaults(func=_import)
