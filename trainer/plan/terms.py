"""A number the planner shows together with how it was reached."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Term:
    name: str
    value: float
    formula: str
    """The formula with its symbols and, after "=", the numbers put in."""

    def to_json(self) -> dict:
        return {"name": self.name, "value": self.value, "formula": self.formula}


def count(value: float) -> str:
    """1234567 -> "1,234,567"; 0.5 -> "0.5"."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.4g}"


def total(terms: list[Term]) -> float:
    return sum(term.value for term in terms)
