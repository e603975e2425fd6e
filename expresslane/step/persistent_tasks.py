"""The persistent step's task list: which task waits for which count (kernels/persistent.py).

Every phase (the embedding, each layer's qkv, attention, wo, swiglu and w2, the head) has a
count for the whole phase and one per lane. A task adds itself to its lane's count and to the
phase's, or to the phase's only where it has no lane (a present-mode projection covers every
lane; the head reads them all). What a task waits for is the plan's choice, `deps`:

- "phase": the whole previous phase, the dependency a kernel boundary gives.
- "lane": what it reads, and no more. Under DTP a lane's layer reads its own lane (laneformer.md
  5): qkv, attention, wo, swiglu and w2 of lane l wait for lane l's previous phase, and the
  lanes meet only through the partials of layer i - broadcast_delay (wo and w2 also wait for
  that layer's whole projection, as a rule long done). Attention also waits for lane 0's qkv,
  whose task records the cache slots' positions; a present-mode projection waits for the whole
  phase before it (it reads every lane), and so does anything after it. Within a phase the tasks
  are lane by lane, so lane 0's next phase can start while the last lane's tasks still run.

Write-after-read needs no waits of its own: every buffer a task writes was last read by a task
that its own chain of waits already covers (tests/test_persistent.py runs the tasks in an order
that respects the waits and keeps lanes apart, and would see a missing one as other bits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kernels import persistent as pk


@dataclass
class Phase:
    total: int  # its count for the whole phase
    lanes: list[int]  # its count per lane
    n: int = 0  # tasks in the phase
    per_lane: list[int] = field(default_factory=list)  # tasks per lane
    laned: bool = True  # every task has a lane


def _coords(*sizes: int) -> list[tuple[int, ...]]:
    """Every coordinate of a grid, the first axis fastest (CUDA's block order)."""
    out: list[tuple[int, ...]] = [()]
    for n in sizes:
        out = [c + (i,) for i in range(n) for c in out]
    return out


class TaskList:
    """Rows of kernels/persistent.py's task list, phase by phase."""

    def __init__(self, lanes: int, deps: str):
        if deps not in ("phase", "lane"):
            raise ValueError(f"deps={deps!r}: expected phase or lane")
        self.L, self.deps = lanes, deps
        self.rows: list[list[int]] = []
        self.n_counts = 0
        self.last: Phase | None = None

    def _target(self, p: Phase, lane: int | None) -> tuple[int, int]:
        """The count that says phase p is done for `lane` (None: all of it), and its target."""
        if lane is None or not p.laned or self.deps == "phase":
            return p.total, p.n
        return p.lanes[lane], p.per_lane[lane]

    def phase(self, kind, layer: int, grid: tuple[int, ...], lane_of, also=None) -> Phase:
        """Appends a phase: a task per coordinate of `grid`, waiting for the previous phase (its
        own lane's part); lane_of(coord) -> its lane or None; also(coord) -> (phase, lane or
        None) or None: a second wait, for the "lane" deps only."""
        L = self.L
        p = Phase(self.n_counts, list(range(self.n_counts + 1, self.n_counts + 1 + L)))
        self.n_counts += 1 + L
        coords = _coords(*grid)
        lanes = [lane_of(c) for c in coords]
        p.n, p.laned = len(coords), all(x is not None for x in lanes)
        p.per_lane = [lanes.count(x) for x in range(L)]
        order = sorted(range(len(coords)), key=lambda j: lanes[j] or 0) if self.deps == "lane" \
            else range(len(coords))  # fmt: skip
        before = self.last
        for j in order:
            c, lane = coords[j], lanes[j]
            a, b, cc = (c + (0, 0, 0))[:3]
            w1 = self._target(before, lane) if before else (0, 0)
            second = also(c) if also and self.deps == "lane" else None
            w2 = self._target(*second) if second else (0, 0)
            laned = self.deps == "lane" and lane is not None and p.laned
            mine = (p.lanes[lane], p.total) if laned else (p.total, -1)
            self.rows.append([int(kind), layer, a, b, cc, *w1, *w2, *mine, 0])
        self.last = p
        return p


def decode_tasks(cfg, S: int, argmax: bool, deps: str, grids: dict, slots: dict) -> TaskList:
    """The step's task list: grids and slots from persistent_plan.build_plan (each kernel's
    grid, and each layer's attention / projection configuration)."""
    L, n_kv = cfg.num_lanes, cfg.num_kv_heads
    kv_lane = n_kv // L  # lane l owns KV heads l * kv_lane ... (and their query heads)
    t = TaskList(L, deps)
    t.phase(pk.EMBED, 0, (S, L), lambda c: c[1])
    wo, w2 = {}, {}
    for i in range(cfg.num_layers):
        qkv = t.phase(pk.QKV, i, grids["QKV"], lambda c: c[0])
        a, j, src = slots["attention"][i], slots["projection"][i], cfg.past_source(i)
        positions = lambda c, q=qkv: (q, 0) if c[1] // kv_lane else None  # noqa: E731  (lane 0's)
        t.phase(pk.ATTN0 + a, i, (S, n_kv, grids["splits"][a]), lambda c: c[1] // kv_lane,
                also=positions)  # fmt: skip
        lane_of = (lambda c: None) if cfg.reduce_mode(i) == "present" else (lambda c: c[1])
        wo[i] = t.phase(pk.WO0 + j, i, grids["WO", j], lane_of,
                        also=lambda c, s=src: None if s is None else (wo[s], None))  # fmt: skip
        t.phase(pk.SWIGLU, i, grids["SWIGLU"], lambda c: c[0])
        w2[i] = t.phase(pk.W20 + j, i, grids["W2", j], lane_of,
                        also=lambda c, s=src: None if s is None else (w2[s], None))  # fmt: skip
    head = grids["HEAD"]
    if argmax:
        t.phase(pk.ARGMAX, 0, head, lambda c: None)
        t.phase(pk.COMBINE, 0, (S,), lambda c: None)
    else:
        t.phase(pk.LOGITS, 0, head, lambda c: None)
    return t
