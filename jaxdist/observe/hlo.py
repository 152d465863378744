"""Reading compiled HLO text: which collectives and custom calls a step runs, and how often per call.

`jitted.lower(...).compile().as_text()` is the program XLA will run after SPMD partitioning.
`collectives` lists every all-reduce / reduce-scatter / all-gather in it with the shapes of its
operands and the number of times it executes per call: loops multiply by their trip count
(XLA records `known_trip_count` on a `while`), so a collective inside a scan over 4 microbatches
counts 4 times. Tests use it to prove that gradients are reduced once per step.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

# Each also as its asynchronous `-start`: XLA prints an async collective either as an `async-start`
# whose called computation holds the plain op (HLO dumps) or as `reduce-scatter-start(...)` with the
# attributes inline (`compiled.as_text()` on GPU); the `-done` halves carry no operand bytes.
REDUCTIONS = ("all-reduce", "all-reduce-start", "reduce-scatter", "reduce-scatter-start")
_COLLECTIVES = (*REDUCTIONS, "all-gather", "all-gather-start", "all-to-all", "all-to-all-start",
                "collective-permute", "collective-permute-start")

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_ARRAY_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")  # (dtype, dims)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_CALLED = re.compile(r"\b(?:calls|to_apply|branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OPERAND = re.compile(r"%([\w.\-]+)(?:#(\d+))?")  # `%x#1`: element 1 of the tuple `%x`
_NAME = re.compile(r"%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program."""

    opcode: str
    computation: str
    operand_shapes: tuple[tuple[int, ...], ...]
    executions: int  # per call of the program: the product of the trip counts of enclosing loops
    operand_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # per execution, by dtype
    # Started to run beside other work (`-start`, or the plain op inside what an `async-start` calls).
    asynchronous: bool = False

    @property
    def in_loop(self) -> bool:
        """Runs more than once per call: inside a loop (a `while` without a known trip count counts once)."""
        return self.executions != 1


@dataclasses.dataclass
class _Computation:
    shapes: dict[str, str] = dataclasses.field(default_factory=dict)
    lines: list[tuple[str, str, str, str]] = dataclasses.field(default_factory=list)
    calls: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (callee, times per call)


def _bytes_by_dtype(shape_text: str) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for dtype, dims in _ARRAY_SHAPE.findall(shape_text):
        if dtype in _DTYPE_BYTES:
            totals[dtype] += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return dict(totals)


def _dims(shape_text: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY_SHAPE.findall(shape_text))


def _tuple_element(shape_text: str, index: int) -> str:
    """Element `index` of a tuple shape's text, "(bf16[4]{0}, s8[64]{0})" -> "s8[64]{0}" for 1."""
    inner = re.sub(r"/\*.*?\*/", "", shape_text).strip()[1:-1]
    elements, depth, start = [], 0, 0
    for position, char in enumerate(inner):
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            elements.append(inner[start:position])
            start = position + 1
    elements.append(inner[start:])
    return elements[index].strip()


def _operand_shape(shapes: dict[str, str], name: str, index: str) -> str:
    shape = shapes.get(name, "")
    return _tuple_element(shape, int(index)) if index and shape.startswith("(") else shape


def _parse(hlo_text: str) -> tuple[dict[str, _Computation], str]:
    computations: dict[str, _Computation] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = computations.setdefault(header.group(1), _Computation())
            if line.startswith("ENTRY"):
                entry = header.group(1)
            continue
        match = _INSTRUCTION.match(line)
        if current is None or not match:
            continue
        name, shape, opcode, rest = match.groups()
        current.shapes[name] = shape
        current.lines.append((name, shape, opcode, rest))
        if opcode == "while":
            trips = _TRIP_COUNT.search(rest)
            times = int(trips.group(1)) if trips else 1
            current.calls += [(_BODY.search(rest).group(1), times), (_CONDITION.search(rest).group(1), times + 1)]
        else:
            for group in _CALLED.findall(rest):
                current.calls += [(callee, 1) for callee in _NAME.findall(group)]
    return computations, entry


def _executions(computations: dict[str, _Computation], entry: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry (call graph is a DAG)."""
    order, seen = [], set()

    def visit(name: str) -> None:
        if name in seen or name not in computations:
            return
        seen.add(name)
        for callee, _ in computations[name].calls:
            visit(callee)
        order.append(name)

    visit(entry)
    counts: dict[str, int] = defaultdict(int, {entry: 1})
    for name in reversed(order):
        for callee, times in computations[name].calls:
            counts[callee] += counts[name] * times
    return counts


def collectives(hlo_text: str, opcodes: tuple[str, ...] = _COLLECTIVES) -> list[Collective]:
    """Every collective of the given opcodes in a compiled HLO module, with executions per call."""
    computations, entry = _parse(hlo_text)
    counts = _executions(computations, entry)
    wrapped = {callee for comp in computations.values() for _, _, opcode, rest in comp.lines if opcode == "async-start"
               for group in _CALLED.findall(rest) for callee in _NAME.findall(group)}
    found = []
    for comp_name, comp in computations.items():
        if counts.get(comp_name, 0) == 0:
            continue
        for _, _, opcode, rest in comp.lines:
            if opcode not in opcodes:
                continue
            args = rest.split(")", 1)[0]
            operands = " ".join(_operand_shape(comp.shapes, name, index) for name, index in _OPERAND.findall(args))
            found.append(Collective(opcode, comp_name, _dims(operands), counts[comp_name], _bytes_by_dtype(operands),
                                    asynchronous=opcode.endswith("-start") or comp_name in wrapped))
    return found


def bytes_per_call(hlo_text: str) -> dict[str, dict[str, int]]:
    """Operand bytes each kind of collective moves per call, by dtype: {"all-reduce": {"f32": n}}.

    Async pairs count once (their `-start`), under the plain opcode name.
    """
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for op in collectives(hlo_text):
        for dtype, size in op.operand_bytes.items():
            totals[op.opcode.removesuffix("-start")][dtype] += size * op.executions
    return {opcode: dict(by_dtype) for opcode, by_dtype in totals.items()}


def waited_collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
    """Per kind of collective, executions per call: (those XLA's schedule runs beside nothing, all).

    On GPU, XLA makes a collective asynchronous (`-start`, `-done`) so that computation can run
    beside it, and turns a pair with nothing scheduled between them back into the plain synchronous
    op, which the step waits for. Those are counted as waited; an asynchronous pair with little
    between is not. (On CPU every collective is synchronous.)
    """
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for op in collectives(hlo_text):
        kind = op.opcode.removesuffix("-start")
        totals[kind][0] += 0 if op.asynchronous else op.executions
        totals[kind][1] += op.executions
    return {kind: (waited, total) for kind, (waited, total) in totals.items()}


@dataclasses.dataclass(frozen=True)
class CustomCall:
    """One custom call of a compiled program: its target (a kernel's runtime handler, e.g. Mosaic
    GPU's or an FFI handler's name), the JAX op path it came from, and executions per call."""

    target: str
    op_name: str
    executions: int


def custom_calls(hlo_text: str) -> list[CustomCall]:
    """Every custom call in a compiled HLO module, with executions per call (loops multiply)."""
    computations, entry = _parse(hlo_text)
    counts = _executions(computations, entry)
    found = []
    for comp_name, comp in computations.items():
        for _, _, opcode, rest in comp.lines:
            if opcode == "custom-call" and counts.get(comp_name, 0):
                op_name = _OP_NAME.search(rest)
                found.append(CustomCall(_TARGET.search(rest).group(1), op_name.group(1) if op_name else "",
                                        counts[comp_name]))
    return found
