"""Speculative decoding's acceptance over a benchmark run, read from the server's /metrics
(vLLM's counters, before and after the run), as vLLM's ``bench serve`` reports it."""

from __future__ import annotations

import re
from typing import Any

import aiohttp

_NAMES = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_LINE = re.compile(r"^vllm:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens"
                   r"|num_accepted_tokens_per_pos)_total\{([^}]*)\}\s+([0-9.eE+-]+)$")
_POSITION = re.compile(r'position="(\d+)"')


def parse(text: str) -> dict[str, Any]:
    """{'num_drafts': n, ..., 'per_pos': {position: n}} summed over the engines."""
    out: dict[str, Any] = dict.fromkeys(_NAMES, 0.0)
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2), float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            pos = _POSITION.search(labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        else:
            out[name] += value
    out["per_pos"] = per_pos
    return out


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any] | None:
    """The counters now, or None when the server has no /metrics."""
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            return parse(await resp.text())
    except (aiohttp.ClientError, OSError):
        return None


def summarize(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """The run's acceptance (empty when nothing was drafted)."""
    if before is None or after is None:
        return {}
    d = {k: after[k] - before[k] for k in _NAMES}
    if d["num_drafts"] <= 0:
        return {}
    positions = sorted(after["per_pos"])
    per_pos = [(after["per_pos"][p] - before["per_pos"].get(p, 0.0)) / d["num_drafts"]
               for p in positions]
    return {
        "spec_num_drafts": int(d["num_drafts"]),
        "spec_num_draft_tokens": int(d["num_draft_tokens"]),
        "spec_num_accepted_tokens": int(d["num_accepted_tokens"]),
        "spec_acceptance_rate": (d["num_accepted_tokens"] / d["num_draft_tokens"]
                                 if d["num_draft_tokens"] else 0.0),
        # Tokens per verification step: the accepted drafts and the one sampled after them.
        "spec_acceptance_length": 1 + d["num_accepted_tokens"] / d["num_drafts"],
        "spec_per_position_acceptance_rate": per_pos,
    }


def report_lines(s: dict[str, Any]) -> list[str]:
    if "spec_num_drafts" not in s:
        return []
    rows = [("Acceptance rate (%):", f"{100 * s['spec_acceptance_rate']:.2f}"),
            ("Acceptance length:", f"{s['spec_acceptance_length']:.2f}"),
            ("Drafts:", s["spec_num_drafts"]),
            ("Draft tokens:", s["spec_num_draft_tokens"]),
            ("Accepted tokens:", s["spec_num_accepted_tokens"])]
    lines = ["{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    if s["spec_per_position_acceptance_rate"]:
        lines.append("Per-position acceptance (%):")
        lines.append("  " + ", ".join(f"{100 * r:.2f}"
                                     for r in s["spec_per_position_acceptance_rate"]))
    return lines
