"""The decode benchmark's table: one line per row (printed as each row is measured, and again in
full at the end with the ratios), and what each row is compared with.

A row that failed prints its error in place of its figures. `used` says what really ran:
G = a captured CUDA graph, F = the fused Triton kernels, P = programmatic dependent launch
(a dash where it did not).
"""

from __future__ import annotations

import json

HEADER = (
    f"{'engine':<30} {'model':<34} {'dev':>3} {'ctx':>6} {'TTFT ms':>9} {'prefill t/s':>12} "
    f"{'decode t/s':>11} {'ms/tok':>8} {'GB/tok':>8} {'GB/s':>8} {'%copy':>6} {'x HF':>6} "
    f"{'x best':>6} used"
)
EAGER_PEER = "transformers"


def _num(r: dict, key: str, fmt: str, width: int, scale: float = 1.0) -> str:
    v = r.get(key)
    return f"{v * scale:{width}{fmt}}" if isinstance(v, (int, float)) else " " * width


def used(r: dict) -> str:
    return "".join(c if r.get(k) else "-" for c, k in
                   (("G", "cuda_graph"), ("F", "fused_kernels"), ("P", "pdl")))  # fmt: skip


def line(r: dict) -> str:
    model = str(r.get("model", ""))[:34]
    head = f"{r['engine']:<30} {model:<34} {r['devices']:>3} {r['context']:>6}"
    if "error" in r:
        return f"{head} ERROR {r['error'][:160]}"
    return (
        f"{head} {r['ttft_ms']:9.1f} {r['prefill_tok_s']:12.1f} {r['decode_tok_s']:11.1f} "
        f"{1e3 / r['decode_tok_s']:8.2f} {_num(r, 'bytes_per_token', '.4f', 8, 1e-9)} "
        f"{_num(r, 'achieved_gb_s', '.1f', 8)} {_num(r, 'copy_bw_util', '.1%', 6)} "
        f"{_num(r, 'speedup_vs_peer', '.2f', 6)} {_num(r, 'speedup_vs_best_peer', '.2f', 6)} "
        f"{used(r)}"
    )


def table(rows: list[dict]) -> str:
    return "\n".join([HEADER, "-" * len(HEADER), *(line(r) for r in rows)])


def compare(rows: list[dict]) -> None:
    """Each ExpressLane row's speed over the eager transformers peer at its context
    (`speedup_vs_peer`) and over the fastest peer that ran there (`speedup_vs_best_peer`)."""
    for r in rows:
        if not r["engine"].startswith("expresslane") or "decode_tok_s" not in r:
            continue
        peers = [p for p in rows if not p["engine"].startswith("expresslane")
                 and p["context"] == r["context"] and "decode_tok_s" in p]  # fmt: skip
        eager = [p for p in peers if p["engine"] == EAGER_PEER]
        if eager:
            r["speedup_vs_peer"] = r["decode_tok_s"] / eager[0]["decode_tok_s"]
        if peers:
            best = max(peers, key=lambda p: p["decode_tok_s"])
            r["speedup_vs_best_peer"] = r["decode_tok_s"] / best["decode_tok_s"]
            r["best_peer"] = best["engine"]


def versus(row: dict, seen: list[dict]) -> str | None:
    """After a peer's row: each ExpressLane row of that context over it (the ratio a streamed
    ExpressLane line could not show yet)."""
    if row["engine"].startswith("expresslane") or "decode_tok_s" not in row:
        return None
    ours = [r for r in seen if r["engine"].startswith("expresslane")
            and r["context"] == row["context"] and "decode_tok_s" in r]  # fmt: skip
    if not ours:
        return None
    ratios = ", ".join(f"{r['engine']} {r['decode_tok_s'] / row['decode_tok_s']:.2f}x"
                       for r in ours)  # fmt: skip
    return f"  vs {row['engine']} at context {row['context']}: {ratios}"


def dumps(obj) -> str:
    """One JSON line; anything JSON cannot hold (paths, dtypes) as text."""
    return json.dumps(obj, default=str)
