"""Reading a traced program (a jaxpr) in tests."""

from __future__ import annotations

from typing import Iterator


def all_eqns(jaxpr) -> Iterator:
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (scan, remat, custom VJPs)."""
    from jax.extend import core as jcore
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for x in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    yield from all_eqns(getattr(x, "jaxpr", x))
