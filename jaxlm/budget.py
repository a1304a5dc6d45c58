"""Fitting `generate`'s plan to a memory budget: the longest `max_seq_len`, in steps of
`SEQ_STEP` tokens, whose whole bill fits (`jaxlm.plan(budget=)`), found with few
compilations."""

from __future__ import annotations

# `plan(budget=)` sizes `max_seq_len` in steps of this many tokens.
SEQ_STEP = 256


def fit(make, floor, limit: int, config, known=()) -> object | None:
    """The plan with the most pages of 256 tokens whose bill fits `limit`, or None.

    Weights and scratch grow linearly with the pages and are known without compiling, so a
    cheap bisection bounds the answer: `top`, the most pages whose weights and scratch fit.
    Plans are compiled only below that bound. If `top`'s bill is over, each next plan compiled
    is the most pages that fit if XLA's temporaries follow a line: through no temporaries at no
    pages and `top`'s at first (a prefill's scores grow with the context), then through the last
    two plans compiled (a decode step's temporaries hardly grow), and bisecting after three
    guesses. Temporaries do not shrink as the pages grow, so once a plan fits, no more pages fit
    than fit beside its temporaries: that bound often ends the search at the plan that fits.
    Usually two or three compilations, where a bisection from one page would take one per
    halving. The bills `known` (`(pages, bill)` of plans built before) count as compiled, so a
    budget just above a plan's bill compiles that plan alone, or loads it from the cache.
    """

    def most_pages(hi: int, extra) -> int:
        # The most pages in [1, hi] whose weights and scratch plus `extra(pages)` fit, or 0.
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if floor(mid * SEQ_STEP) + extra(mid) <= limit else (lo, mid - 1)
        return lo

    top = most_pages(max(1, -(-config.max_position_embeddings // SEQ_STEP)), lambda pages: 0)
    if top < 1:
        return None
    # `lo` pages fit (0: none known to), more than `hi` do not; (pages, temporaries) of the
    # plans known, the latest last.
    lo, hi, best, seen = 0, top, None, [(0, 0)]

    def learn(pages: int, bill: int) -> None:
        nonlocal lo, hi
        temporaries = bill - floor(pages * SEQ_STEP)
        seen.append((pages, temporaries))
        if bill <= limit:
            lo = max(lo, pages)
            hi = max(lo, most_pages(hi, lambda _, t=temporaries: t))
        else:
            hi = min(hi, pages - 1)

    for pages, bill in sorted(known):
        if 1 <= pages <= top:
            learn(pages, bill)
    if hi == top and lo < top:
        best = make(top * SEQ_STEP)
        if best.total_bytes <= limit:
            return best
        learn(top, best.total_bytes)
        best = None

    def line(pages: int) -> int:
        (p0, t0), (p1, t1) = seen[-2:]
        return t0 + (t1 - t0) * (pages - p0) // (p1 - p0)

    guesses = 0
    while lo < hi:
        # Bisection after three guesses, should the temporaries follow no line.
        guess = most_pages(hi, line) if guesses < 3 else (lo + hi + 1) // 2
        guesses += 1
        probe = min(hi, max(lo + 1, guess))
        candidate = make(probe * SEQ_STEP)
        learn(probe, candidate.total_bytes)
        best = candidate if candidate.total_bytes <= limit else best
    # A plan compiled last fitted with `lo` pages; without one, `lo` is a bill known before.
    return best if best is not None or not lo else make(lo * SEQ_STEP)
