"""The timing loop of the A/B comparison scripts (custom_ops/compare.py, custom_ops/channel_ab.py,
one_engine/compare.py): two versions of the package interleaved in one process."""
import statistics
import time


def interleaved(f, new, old, calls: int) -> dict:
    """``f(package)`` for the two packages, one warm-up call each, then ``calls`` calls each with the
    order swapped every call (new old, old new, ...): the medians in seconds and their ratio,
    ``{"new": s, "old": s, "new/old": r}``. ``f`` does the whole timed work (forward and backward)."""
    for package in (new, old):
        f(package)
    times = {"new": [], "old": []}
    for rep in range(calls):
        order = (("new", new), ("old", old))
        for label, package in (order[::-1] if rep % 2 else order):
            t0 = time.perf_counter()
            f(package)
            times[label].append(time.perf_counter() - t0)
    row = {label: statistics.median(t) for label, t in times.items()}
    row["new/old"] = row["new"] / row["old"]
    return row
