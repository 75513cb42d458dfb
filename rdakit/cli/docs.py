"""Tables in ``docs/`` generated from their single definition in code.

A generated section sits between ``<!-- BEGIN GENERATED: name -->`` and
``<!-- END GENERATED: name -->``. ``rdakit docs`` rewrites them; a test fails when a document is
out of date.
"""

import pathlib
import re

from rdakit.boards.build import BOARDS, board_preset
from rdakit.compiler.frontend.aten import ATEN_OPS
from rdakit.compiler.graph import OP_KINDS
from rdakit.hdl.memory.unit import CHECK_ORDER, TIMING
from rdakit.hdl.spec.bitstream import LOAD_STATUS_DOC, LoadStatus
from rdakit.hdl.spec.cu import STREAM_HAZARDS, STREAM_TOUCH_DOC
from rdakit.hdl.spec.frames import (
    ERROR_DOC,
    FIELD_DOC,
    KIND_DOC,
    FrameError,
    FrameKind,
    cmd_bytes,
    reply_bytes,
)
from rdakit.hdl.spec.isa import OP_INFO, AluFn, BMode, DMode, StreamField
from rdakit.hdl.spec.packets import (
    OP_DOC,
    STATUS_DOC,
    MUOp,
    MUStatus,
    mu_request_layout,
    mu_response_layout,
)
from rdakit.hdl.spec.params import MUParams, fabric_params
from rdakit.sim.verify.formal_harness import properties_table

__all__ = ["SECTIONS", "render", "update", "register"]

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def _mu_ops():
    lines = ["| opcode | operation | request | response |", "|---|---|---|---|"]
    for op in MUOp:
        req, resp = OP_DOC[op]
        lines.append(f"| {op.value} | `{op.name}` | {req} | {resp} |")
    lines += ["", "| status | name | meaning |", "|---|---|---|"]
    for st in MUStatus:
        lines.append(f"| {st.value} | `{st.name}` | {STATUS_DOC[st]} |")
    return "\n".join(lines)


def _mu_checks():
    lines = ["| op | checks after the mode check |", "|---|---|"]
    lines += [f"| {op.name} | {CHECK_ORDER[op]} |" for op in MUOp]
    return "\n".join(lines)


def _mu_timing():
    lines = ["| op | execute cycles (latency: one more) |", "|---|---|"]
    lines += [f"| {op.name} | {TIMING[op]} |" for op in MUOp]
    return "\n".join(lines)


def _mu_packets():
    p = MUParams()
    lines = []
    for title, layout in (("request", mu_request_layout(p)), ("response", mu_response_layout(p))):
        lines += [f"{title.capitalize()} with the default parameters ({layout.size} bits):", "",
                  "| field | bits | width |", "|---|---|---|"]
        for name, field in layout:
            lines.append(f"| `{name}` | {field.offset + field.width - 1}:{field.offset} "
                         f"| {field.width} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def _isa():
    lines = ["| opcode | syntax | semantics | cycles |", "|---|---|---|---|"]
    for op, (syntax, sem, cycles) in OP_INFO.items():
        lines.append(f"| {op.value} | `{syntax}` | {sem} | {cycles} |")
    for title, enum in (("ALU function (fn)", AluFn), ("stream field (fn of SCFG)", StreamField),
                        ("B_MODE", BMode), ("D_MODE", DMode)):
        lines += ["", f"| {title} | value |", "|---|---|"]
        lines += [f"| `{m.name}` | {m.value} |" for m in enum]
    return "\n".join(lines)


def _stream_hazards():
    lines = ["| instruction | waits for every stream in the engine that |", "|---|---|"]
    for op, touches in STREAM_HAZARDS.items():
        what = "; ".join(STREAM_TOUCH_DOC[t] for t in touches) or "(none: it never waits)"
        lines.append(f"| `{op.name}` | {what} |")
    return "\n".join(lines)


def _properties():
    return properties_table()


def _frames():
    lines = ["| byte | field | meaning |", "|---|---|---|"]
    lines += [f"| {at} | {field} | {meaning} |" for at, field, meaning in FIELD_DOC]
    lines += ["", "| kind | value | from | payload | answer |", "|---|---|---|---|---|"]
    for k in FrameKind:
        frm, payload, answer = KIND_DOC[k]
        lines.append(f"| `{k.name}` | 0x{k.value:02X} | {frm} | {payload} | {answer} |")
    lines += ["", "| error | code | meaning |", "|---|---|---|"]
    for e in FrameError:
        lines.append(f"| `{e.name}` | {e.value} | {ERROR_DOC[e]} |")
    lines += ["", "| board preset | command payload (max) | reply payload (max) |",
              "|---|---|---|"]
    for b in BOARDS:
        p = fabric_params(2, 2, **board_preset(b))
        lines.append(f"| {b} | {cmd_bytes(p.mu)} bytes | {reply_bytes(p.mu)} bytes |")
    return "\n".join(lines)


def _ir_ops():
    lines = ["| kind | inputs | meaning |", "|---|---|---|"]
    for kind, spec in OP_KINDS.items():
        arity = spec.arity if spec.arity is not None else f">= {spec.min_inputs}"
        lines.append(f"| `{kind}` | {arity} | {spec.doc} |")
    return "\n".join(lines)


def _load_status():
    lines = ["| status | code | meaning |", "|---|---|---|"]
    lines += [f"| `{st.name}` | {st.value} | {LOAD_STATUS_DOC[st]} |" for st in LoadStatus]
    return "\n".join(lines)


def _aten_ops():
    lines = ["| aten op | IR op(s) | how |", "|---|---|---|"]
    for name, op in ATEN_OPS.items():
        ir = ", ".join(f"`{k}`" for k in op.ir) or "-"
        lines.append(f"| `{name}` | {'(view) ' if op.layout else ''}{ir} | {op.note} |")
    return "\n".join(lines)


#: file name in docs/ -> section name -> function returning the Markdown.
SECTIONS = {
    "memory-unit.md": {"ops": _mu_ops, "packets": _mu_packets, "checks": _mu_checks,
                       "timing": _mu_timing},
    "compute-unit.md": {"isa": _isa, "stream-hazards": _stream_hazards},
    "compiler.md": {"ir": _ir_ops},
    "verification.md": {"properties": _properties},
    "boards.md": {"frames": _frames},
    "bitstream.md": {"load-status": _load_status},
    "import.md": {"aten-ops": _aten_ops},
}


def render(text, sections):
    for name, fn in sections.items():
        pattern = re.compile(rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: "
                             rf"{name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"Section {name!r} has no BEGIN/END GENERATED markers")
        text = pattern.sub(lambda m, fn=fn: m.group(1) + fn() + "\n" + m.group(2), text)
    return text


def update(*, check=False):
    """Rewrite the generated sections; with ``check``, return the files that are stale."""
    stale = []
    for file, sections in SECTIONS.items():
        path = DOCS / file
        old = path.read_text()
        new = render(old, sections)
        if new != old:
            stale.append(path)
            if not check:
                path.write_text(new)
    return stale


def _docs(args):
    stale = update(check=args.check)
    for path in stale:
        print(f"{'stale' if args.check else 'updated'}: {path}")
    return 1 if (args.check and stale) else 0


def register(commands):
    p = commands.add_parser("docs", help="regenerate the tables in docs/ from the code",
                            description="Rewrite the generated tables of docs/ (opcodes, "
                                        "packet layouts) from their definitions in code.")
    p.add_argument("--check", action="store_true", help="only report stale files (exit 1)")
    p.set_defaults(func=_docs)
