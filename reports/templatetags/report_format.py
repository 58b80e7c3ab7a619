"""Number formats of the PDF reports: {% load report_format %}."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django import template

register = template.Library()

DASH = "\u2013"


@register.filter
def number(value: Any) -> str:
    """12,345 (thousands separated); a dash for nothing."""
    if value is None or value == "":
        return DASH
    return f"{value:,.0f}" if isinstance(value, (float, Decimal)) else f"{value:,}"


@register.filter
def money(value: Any) -> str:
    """$12,345.67"""
    if value is None:
        return DASH
    return f"${Decimal(value):,.2f}"


@register.filter
def percent(value: Any, digits: int = 1) -> str:
    """0.917 -> 91.7%"""
    if value is None:
        return DASH
    return f"{float(value) * 100:.{int(digits)}f}%"


@register.filter
def change(value: Any) -> str:
    """0.12 -> +12.0%, -0.05 -> -5.0% (vs the previous period)."""
    if value is None:
        return "new"
    return f"{float(value) * 100:+.1f}%"


@register.filter
def change_class(value: Any) -> str:
    if value is None:
        return "flat"
    return "up" if value > 0.0005 else ("down" if value < -0.0005 else "flat")


@register.filter
def seconds(value: Any) -> str:
    """A duration: 850 ms, 2.41 s, 3 min 05 s."""
    if value is None:
        return DASH
    value = float(value)
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.2f} s"
    minutes, rest = divmod(round(value), 60)
    return f"{minutes} min {rest:02d} s"


@register.filter
def width(value: Any) -> str:
    """A share (0-1) as a CSS width percentage, clamped."""
    return f"{max(0.0, min(1.0, float(value or 0))) * 100:.1f}%"
