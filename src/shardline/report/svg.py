"""The report's pictures as inline SVG: the loss curve and the lineage chain (no scripts, no external assets)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any

__all__ = ["STATUS_COLORS", "lineage_svg", "loss_svg", "nice_ticks"]

# fill, stroke per checkpoint status
STATUS_COLORS = {
    "verified": ("#e6f4ea", "#1e8e3e"),
    "failed": ("#fce8e6", "#d93025"),
    "deleted": ("#f1f3f4", "#80868b"),
    "moved aside": ("#fef7e0", "#e37400"),
}
_EVENT_COLORS = ("#f8f9fa", "#9aa0a6")
_MAX_POINTS = 1200


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out, x = [], first
    while x <= hi + step * 1e-9:
        out.append(round(x, 10))
        x += step
    return out


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.3g}"


def loss_svg(
    train: Sequence[tuple[int, float]], val: Sequence[tuple[int, float]], *, width: int = 760, height: int = 300
) -> str:
    """A line chart of training loss per step (and validation loss as dots), as an ``<svg>`` element."""
    points = [(s, v) for s, v in train if math.isfinite(v)]
    vpoints = [(s, v) for s, v in val if math.isfinite(v)]
    if not points and not vpoints:
        return ""
    if len(points) > _MAX_POINTS:  # keep the page small: every k-th point, the last one kept
        k = math.ceil(len(points) / _MAX_POINTS)
        points = points[::k] + ([points[-1]] if (len(points) - 1) % k else [])
    every = points + vpoints
    x_lo, x_hi = min(s for s, _ in every), max(s for s, _ in every)
    y_lo, y_hi = min(v for _, v in every), max(v for _, v in every)
    if x_hi == x_lo:
        x_hi = x_lo + 1
    pad = (y_hi - y_lo) * 0.05 or 0.5
    y_lo, y_hi = y_lo - pad, y_hi + pad
    left, right, top, bottom = 64, 16, 16, 44
    w, h = width - left - right, height - top - bottom

    def x(s: float) -> float:
        return left + (s - x_lo) / (x_hi - x_lo) * w

    def y(v: float) -> float:
        return top + (1 - (v - y_lo) / (y_hi - y_lo)) * h

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="loss" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="training loss by step">',
        f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="#fff" stroke="#dadce0"/>',
    ]
    for t in nice_ticks(y_lo, y_hi):
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#f1f3f4"/>')
        parts.append(f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end" class="tick">{_fmt(t)}</text>')
    for t in nice_ticks(x_lo, x_hi):
        parts.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top + h}" y2="{top + h + 4}" stroke="#5f6368"/>')
        parts.append(f'<text x="{x(t):.1f}" y="{top + h + 17}" text-anchor="middle" class="tick">{_fmt(t)}</text>')
    parts.append(
        f'<text x="{left + w / 2}" y="{height - 6}" text-anchor="middle" class="axis">optimizer step</text>'
        f'<text x="14" y="{top + h / 2}" text-anchor="middle" class="axis" '
        f'transform="rotate(-90 14 {top + h / 2})">loss</text>'
    )
    if points:
        coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
        parts.append(f'<polyline class="train" points="{coords}" fill="none" stroke="#1a73e8" stroke-width="1.4"/>')
    if vpoints:
        coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in vpoints)
        parts.append(f'<polyline class="val" points="{coords}" fill="none" stroke="#e8710a" stroke-width="1.8"/>')
        parts += [f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3.2" fill="#e8710a"/>' for s, v in vpoints]
    legend_y = top + 14
    parts.append(
        f'<line x1="{left + w - 190}" x2="{left + w - 170}" y1="{legend_y}" y2="{legend_y}" stroke="#1a73e8" '
        f'stroke-width="2"/><text x="{left + w - 165}" y="{legend_y + 4}" class="tick">training loss</text>'
        f'<circle cx="{left + w - 80}" cy="{legend_y}" r="3.2" fill="#e8710a"/>'
        f'<text x="{left + w - 72}" y="{legend_y + 4}" class="tick">validation</text>'
    )
    parts.append("</svg>")
    return "".join(parts)


def _clip(text: str, limit: int = 96) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def lineage_svg(nodes: Sequence[dict[str, Any]], *, width: int = 820) -> str:
    """The chain as a picture: one box per ledger row, top to bottom, arrows from each checkpoint to its parent.

    ``nodes``: ``{"kind": "commit"|"event", "label", "detail", "status" (commits), "id" (manifest hash,
    commits), "parent" (manifest hash or None)}`` in ledger order.
    """
    if not nodes:
        return ""
    box_h, event_h, gap, x0 = 46, 30, 18, 112
    box_w = width - x0 - 16
    ys: list[float] = []
    y = 12.0
    for node in nodes:
        ys.append(y)
        y += (box_h if node["kind"] == "commit" else event_h) + gap
    height = int(y)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="lineage" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="lineage chain">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#5f6368"/></marker></defs>',
    ]
    where = {n["id"]: i for i, n in enumerate(nodes) if n["kind"] == "commit" and n.get("id")}
    for i, node in enumerate(nodes):
        parent = node.get("parent")
        if node["kind"] != "commit" or not parent or parent not in where:
            continue
        j = where[parent]
        y_child, y_parent = ys[i] + box_h / 2, ys[j] + box_h / 2
        bulge = 18 + 12 * min(sum(1 for k in range(j + 1, i) if nodes[k]["kind"] == "commit"), 5)
        parts.append(
            f'<path class="edge" d="M{x0},{y_child:.1f} C{x0 - bulge},{y_child:.1f} {x0 - bulge},{y_parent:.1f} '
            f'{x0},{y_parent:.1f}" fill="none" stroke="#5f6368" stroke-width="1.3" marker-end="url(#arrow)"/>'
        )
    for i, node in enumerate(nodes):
        top = ys[i]
        if node["kind"] == "commit":
            fill, stroke = STATUS_COLORS.get(node["status"], _EVENT_COLORS)
            dash = ' stroke-dasharray="5 3"' if node["status"] == "deleted" else ""
            parts.append(
                f'<rect class="node {escape(node["status"])}" x="{x0}" y="{top}" width="{box_w}" height="{box_h}" '
                f'rx="7" fill="{fill}" stroke="{stroke}" stroke-width="1.6"{dash}/>'
                f'<text x="{x0 + 12}" y="{top + 19}" class="label">{escape(node["label"])}</text>'
                f'<text x="{x0 + 12}" y="{top + 36}" class="small">{escape(node["detail"])}</text>'
                f'<text x="{x0 + box_w - 12}" y="{top + 19}" text-anchor="end" class="status" fill="{stroke}">'
                f"{escape(node['status'].upper())}</text>"
            )
        else:
            fill, stroke = _EVENT_COLORS
            parts.append(
                f'<rect class="event" x="{x0 + 40}" y="{top}" width="{box_w - 40}" height="{event_h}" rx="15" '
                f'fill="{fill}" stroke="{stroke}"/>'
                f'<text x="{x0 + 56}" y="{top + 19}" class="small">'
                f"{escape(_clip(node['label'] + ': ' + node['detail']))}</text>"
            )
        parts.append(f'<text x="6" y="{top + 19}" class="tick">#{node["seq"]}</text>')
    parts.append("</svg>")
    return "".join(parts)
