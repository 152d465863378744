"""Reading a traced program: every equation of a jaxpr and of the jaxprs inside it."""

from __future__ import annotations

from collections.abc import Iterator


def equations(jaxpr, in_loop: bool = False) -> Iterator[tuple[object, bool]]:
    """(equation, inside a scan or while loop?) for each equation, sub-jaxprs included once per call site."""
    for eqn in jaxpr.eqns:
        yield eqn, in_loop
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner, in_loop or eqn.primitive.name in ("scan", "while"))
