"""Fewer points than a chart has pixels, without losing what a user looks for: per bucket of steps the
first, lowest, highest and last point are kept (M4), so a spike or a dip of one step stays on the chart
however far it is zoomed out, and the line's shape between buckets is the real one."""

import math
from collections.abc import Sequence


def bucket_width(first: int, last: int, buckets: int) -> int:
    """Steps per bucket so that [first, last] makes at most `buckets` buckets."""
    return max(1, math.ceil((last - first + 1) / max(1, buckets)))


def min_max(steps: Sequence[int], values: Sequence[float | None], buckets: int) -> tuple[list[int], list[float | None]]:
    """Downsample a step-ordered series to at most 4 points per bucket. Missing values (None) are kept
    where they fall between kept points only if a bucket holds nothing else, so a gap stays a gap."""
    if len(steps) <= 4 * buckets:
        return list(steps), list(values)
    width = bucket_width(steps[0], steps[-1], buckets)
    kept_steps: list[int] = []
    kept_values: list[float | None] = []
    start = 0
    while start < len(steps):
        bucket = (steps[start] - steps[0]) // width
        end = start
        while end < len(steps) and (steps[end] - steps[0]) // width == bucket:
            end += 1
        present = [index for index in range(start, end) if values[index] is not None]
        if not present:
            kept = [start]
        else:
            lowest = min(present, key=lambda index: values[index])
            highest = max(present, key=lambda index: values[index])
            kept = sorted({present[0], lowest, highest, present[-1]})
        kept_steps.extend(steps[index] for index in kept)
        kept_values.extend(values[index] for index in kept)
        start = end
    return kept_steps, kept_values
