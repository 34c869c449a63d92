"""What the run page's charts read: run-level series, per-rank lines or bands, the rank × step heatmap
and the rank × rank communication matrix, each sized to the chart rather than to the run.

Every answer starts with the run's last_seq read before the rows: a page draws the answer, then applies
the events after that seq, and a point in both is the same (attempt, rank, step), drawn once.
"""

import functools
import json
import math
from collections import defaultdict
from typing import NamedTuple

from django.db import connection
from django.db.models import F, FloatField, Max, Min, QuerySet
from django.db.models.expressions import Combinable
from django.db.models.functions import Cast, NullIf

from loom.runs.models import Attempt, Run
from trainer.config import parse_config
from trainer.plan.traffic import predicted_rows

from .downsample import min_max
from .median import Median
from .models import Event, RankStatus, RankStep, RankTile
from .store import TILE_SPANS

SERIES = ("loss_mean", "eval_loss", "grad_norm", "lr", "tokens_per_s", "mfu")
# Series of the steps that report them only (validation loss, every eval.interval_steps): the steps between
# are no gap in the curve.
SPARSE_SERIES = frozenset({"eval_loss"})
RANK_METRICS = {"step_time_s": "step_time", "memory_bytes": "memory", "compute_s": "compute"}
# Attempts with more ranks than this get a band (min/median/max over ranks) unless ranks are picked.
LINE_RANKS_MAX = 8
# Rank × bucket cells one heatmap or band reads and sends at most: 1,024 ranks get ~250 columns.
CELLS_MAX = 256 * 1024
# Larger worlds are drawn in blocks of ranks, so a matrix stays at most this many cells on a side.
MATRIX_SIDE_MAX = 256


class ChartInputError(ValueError):
    """A bad query parameter: `errors` maps the parameter to what was wrong."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


def attempt_of(run: Run, number: int | None) -> Attempt:
    attempts = run.attempts.order_by("-number")
    attempt = attempts.filter(number=number).first() if number is not None else attempts.first()
    if attempt is None:
        valid = sorted(run.attempts.values_list("number", flat=True))
        raise ChartInputError({"attempt": f"run {run.pk} has no attempt {number}; valid choices are {valid}"})
    return attempt


def last_seq_of(run: Run) -> int:
    """The run's latest stored seq, read before a chart's rows (the module docstring says why)."""
    return Run.objects.values_list("last_seq", flat=True).get(pk=run.pk)


def _step_range(attempt: Attempt, start: int | None, end: int | None) -> tuple[int, int] | None:
    """[start, end] clipped to the steps the attempt has reported; None when it has none there."""
    bounds = RankStep.objects.filter(attempt=attempt).aggregate(first=Min("step"), last=Max("step"))
    if bounds["first"] is None:
        return None
    first = bounds["first"] if start is None else max(start, bounds["first"])
    last = bounds["last"] if end is None else min(end, bounds["last"])
    return (first, last) if first <= last else None


def _data_parallel(config: dict) -> int:
    parallel = config.get("parallel", {})
    return parallel.get("dp_replicate", 1) * parallel.get("dp_shard", 1)


def _world_size(attempt: Attempt) -> int:
    return parse_config(attempt.config).parallel.world_size


def series(run: Run, width: int, start: int | None = None, end: int | None = None) -> dict:
    """Per attempt, the run-level curves over steps. Loss (mean over ranks), validation loss (on the steps
    evaluated), grad norm, lr and MFU are the same on every rank, so the lowest reporting rank's are the
    run's; its batch's tokens/s times the data-parallel degree is the run's."""
    last_seq = last_seq_of(run)
    answers = []
    for attempt in run.attempts.order_by("number"):
        data_parallel = _data_parallel(attempt.config)
        reference = RankStep.objects.filter(attempt=attempt).aggregate(rank=Min("rank"))["rank"]
        rows = RankStep.objects.filter(attempt=attempt, rank=reference if reference is not None else 0)
        if start is not None:
            rows = rows.filter(step__gte=start)
        if end is not None:
            rows = rows.filter(step__lte=end)
        table = list(rows.order_by("step").values_list("step", *SERIES))
        steps = [row[0] for row in table]
        curves = {}
        for index, name in enumerate(SERIES, start=1):
            values = [row[index] for row in table]
            if name == "tokens_per_s":
                values = [None if value is None else value * data_parallel for value in values]
            shown_steps = steps
            if name in SPARSE_SERIES:
                shown_steps = [step for step, value in zip(steps, values, strict=True) if value is not None]
                values = [value for value in values if value is not None]
            kept_steps, kept_values = min_max(shown_steps, values, max(1, width // 2))
            curves[name] = {"step": kept_steps, "value": kept_values}
        answers.append(
            {
                "attempt": attempt.number,
                "world_size": _world_size(attempt),
                "data_parallel": data_parallel,
                "series": curves,
            }
        )
    return {"last_seq": last_seq, "attempts": answers}


def _span(first: int, last: int, columns: int) -> int:
    """The finest resolution (raw steps, or a tile span) that fits the range into `columns`."""
    for span in (1, *TILE_SPANS):
        if math.ceil((last - first + 1) / span) <= columns:
            return span
    return TILE_SPANS[-1]


class _Cells(NamedTuple):
    """The rows behind a per-rank chart at a span (raw steps or tiles) and, as expressions over a row, its
    bucket's first step and the metric's lowest, mean and highest value over the bucket."""

    rows: QuerySet
    start: Combinable
    low: Combinable
    mean: Combinable
    high: Combinable


def _cells(attempt: Attempt, metric: str, first: int, last: int, span: int) -> _Cells:
    if span == 1:
        rows = RankStep.objects.filter(attempt=attempt, step__gte=first, step__lte=last)
        return _Cells(rows, F("step"), F(metric), Cast(metric, FloatField()), F(metric))
    prefix = RANK_METRICS[metric]
    rows = RankTile.objects.filter(attempt=attempt, span=span, bucket__gte=first // span, bucket__lte=last // span)
    mean = F(f"{prefix}_sum") / NullIf("count", 0)
    return _Cells(rows, F("bucket") * span, F(f"{prefix}_min"), mean, F(f"{prefix}_max"))


def _fetch(rows: QuerySet) -> list[tuple]:
    """A values_list's rows straight from the database cursor: Django passes every computed float through
    a converter, which for a heatmap's 160,000 cells cost more than reading them."""
    sql, params = rows.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def _per_rank_chart(run: Run, metric: str, number: int | None) -> tuple[int, Attempt, int]:
    """(last_seq, attempt, world size) for a per-rank chart of `metric`, after checking the metric."""
    if metric not in RANK_METRICS:
        raise ChartInputError({"metric": f"unknown metric {metric!r}; valid choices are {sorted(RANK_METRICS)}"})
    last_seq = last_seq_of(run)
    attempt = attempt_of(run, number)
    return last_seq, attempt, _world_size(attempt)


def rank_metric(
    run: Run,
    metric: str,
    width: int,
    number: int | None = None,
    start: int | None = None,
    end: int | None = None,
    ranks: list[int] | None = None,
) -> dict:
    """A per-rank metric over steps: lines (min, mean, max per bucket) for a few ranks, else a band:
    per bucket the lowest rank's min, the median over ranks of their means, and the highest max."""
    last_seq, attempt, world = _per_rank_chart(run, metric, number)
    bad = [rank for rank in ranks or [] if not 0 <= rank < world]
    if bad:
        raise ChartInputError({"ranks": f"ranks {bad} are not in this attempt's 0…{world - 1}"})
    answer = {"last_seq": last_seq, "attempt": attempt.number, "metric": metric, "world_size": world}
    as_lines = ranks is not None or world <= LINE_RANKS_MAX
    bounds = _step_range(attempt, start, end)
    if bounds is None:
        empty = {"lines": {}} if as_lines else {"band": {"step": [], "min": [], "median": [], "max": []}}
        return answer | {"span": 1} | empty
    shown = len(ranks) if ranks is not None else world
    columns = max(1, width // 2) if as_lines else max(1, min(width // 2, CELLS_MAX // max(1, shown)))
    span = _span(*bounds, columns)
    if not as_lines:
        return answer | {"span": span, "band": _band(attempt, metric, *bounds, span)}
    cells = _cells(attempt, metric, *bounds, span)
    rows = cells.rows.filter(rank__in=ranks) if ranks is not None else cells.rows
    lines: dict[str, dict[str, list]] = {}
    for rank, start, lowest, mean, highest in rows.values_list(
        "rank", cells.start, cells.low, cells.mean, cells.high
    ).order_by("rank", cells.start):
        line = lines.setdefault(str(rank), {"step": [], "min": [], "mean": [], "max": []})
        line["step"].append(start)
        line["min"].append(lowest)
        line["mean"].append(mean)
        line["max"].append(highest)
    return answer | {"span": span, "lines": lines}


def _band(attempt: Attempt, metric: str, first: int, last: int, span: int) -> dict:
    """Per bucket the lowest rank's min, the median over ranks of their means and the highest max, grouped
    by the database: a 1,024-rank band reads ~250 rows here, not every rank's tiles."""
    cells = _cells(attempt, metric, first, last, span)
    grouped = cells.rows.values(start=cells.start).annotate(
        low=Min(cells.low), middle=Median(cells.mean), high=Max(cells.high)
    )
    band = {"step": [], "min": [], "median": [], "max": []}
    for start, lowest, middle, highest in grouped.values_list("start", "low", "middle", "high").order_by("start"):
        band["step"].append(start)
        band["min"].append(lowest)
        band["median"].append(middle)
        band["max"].append(highest)
    return band


def heatmap(
    run: Run,
    metric: str,
    width: int,
    number: int | None = None,
    start: int | None = None,
    end: int | None = None,
    span: int | None = None,
) -> dict:
    """Rank × step: each rank's mean of the metric per bucket of steps (a slow rank is a stripe), with the
    host each rank last reported from. `span` asks for buckets of that many steps (a page following the
    run asks for its last bucket onwards at the span it shows) instead of the finest that fits `width`."""
    if span is not None and span not in (1, *TILE_SPANS):
        raise ChartInputError({"span": f"no buckets of {span} steps are kept; valid choices are {[1, *TILE_SPANS]}"})
    last_seq, attempt, world = _per_rank_chart(run, metric, number)
    hosts = [""] * world
    for rank, host in RankStatus.objects.filter(attempt=attempt, rank__lt=world).values_list("rank", "host"):
        if rank >= 0:
            hosts[rank] = host
    answer = {"last_seq": last_seq, "attempt": attempt.number, "metric": metric, "ranks": list(range(world))}
    bounds = _step_range(attempt, start, end)
    if bounds is None:
        return answer | {"span": span or 1, "steps": [], "hosts": hosts, "z": [[] for _ in range(world)]}
    columns = max(1, min(width, CELLS_MAX // world))
    if span is not None and math.ceil((bounds[1] - bounds[0] + 1) / span) > columns:
        too_many = f"{span}-step buckets over steps {bounds[0]}–{bounds[1]} exceed {columns} columns"
        raise ChartInputError({"span": too_many})
    span = span or _span(*bounds, columns)
    cells = _cells(attempt, metric, *bounds, span)
    first_start = bounds[0] // span * span
    grid = [[None] * ((bounds[1] - first_start) // span + 1) for _ in range(world)]
    filled = set()
    for rank, start, mean in _fetch(cells.rows.filter(rank__lt=world).values_list("rank", cells.start, cells.mean)):
        column = (start - first_start) // span
        grid[rank][column] = mean
        filled.add(column)
    columns_shown = sorted(filled)
    steps = [first_start + column * span for column in columns_shown]
    z = [[row[column] for column in columns_shown] for row in grid]
    return answer | {"span": span, "steps": steps, "hosts": hosts, "z": z}


def comm(run: Run, number: int | None = None, start: int | None = None, end: int | None = None) -> dict:
    """Measured bytes per step between ranks over the chosen windows (default: the latest), beside the
    planner's prediction for the attempt's layout, each cell labelled by the kind carrying the most."""
    attempt = attempt_of(run, number)
    config = parse_config(attempt.config)
    world = config.parallel.world_size
    block = math.ceil(world / MATRIX_SIDE_MAX)
    comm_events = Event.objects.filter(attempt=attempt, kind="comm")
    windows = sorted({tuple(window) for window in _windows(comm_events)})
    if start is None and end is None:
        chosen = windows[-1:]
    else:
        low = start if start is not None else -math.inf
        high = end if end is not None else math.inf
        chosen = [window for window in windows if low <= window[0] and window[1] <= high]
    steps = sum(last - first + 1 for first, last in chosen)
    rows = [
        payload
        for payload in comm_events.filter(step__in=[last for _, last in chosen]).values_list("payload", flat=True)
        if tuple(payload.get("window", ())) in set(chosen)
    ]
    answer = {
        "attempt": attempt.number,
        "world_size": world,
        "block": block,
        "windows": [list(window) for window in windows],
        "window": [chosen[0][0], chosen[-1][1]] if chosen else None,
        "steps": steps,
        "measured": _matrix(rows, world, block, steps),
        "predicted": None,
        "predicted_error": "",
    }
    try:
        answer["predicted"] = _predicted_matrix(json.dumps(attempt.config, sort_keys=True), block)
    except ValueError as error:
        answer["predicted_error"] = str(error)
    return answer


@functools.lru_cache(maxsize=16)
def _predicted_matrix(config_json: str, block: int) -> dict:
    """The planner's matrix for a layout: an attempt's config never changes, and at 1,024 ranks the
    prediction costs ~100 ms of CPU that a page following the run would otherwise ask for every few
    seconds, on the process that also serves ingest. Callers must not change the answer."""
    config = parse_config(json.loads(config_json))
    return _matrix(predicted_rows(config), config.parallel.world_size, block, 1)


def _windows(comm_events) -> list[list[int]]:
    """Every window the attempt measured; all ranks close the same windows, so the lowest rank's tell. Both
    reads follow the index of comm events by rank: the first entry, then that rank's entries."""
    ranked = comm_events.filter(rank__isnull=False)
    lowest = ranked.order_by("rank").values_list("rank", flat=True).first()
    windows = ranked.filter(rank=lowest).values_list("payload__window", flat=True)
    return [window for window in windows if isinstance(window, list) and len(window) == 2]


def _matrix(rows: list[dict], world: int, block: int, steps: int) -> dict:
    """Bytes per step from src to dst (blocks of `block` ranks), the kind carrying most of each cell, and
    each kind's own cells ([src, dst, bytes] where it sent anything), for a page showing one kind. Only the
    cells something was sent between are visited: a 1,024-rank row reaches a handful of ranks, and
    visiting all 256 × 256 cells per kind took ~100 ms of the answer."""
    side = math.ceil(world / block)
    by_kind: dict[str, dict[tuple[int, int], float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        source = row["rank"] // block
        for destination, nbytes, kind, _ops in row["sends"]:
            if 0 <= destination < world:
                by_kind[kind][source, destination // block] += nbytes / max(1, steps)
    total = [[0.0] * side for _ in range(side)]
    kinds = [[""] * side for _ in range(side)]
    heaviest: dict[tuple[int, int], float] = {}
    for kind, cells in by_kind.items():
        for (i, j), value in cells.items():
            total[i][j] += value
            # The first kind to carry the most, in the order the kinds first appeared.
            if value > heaviest.get((i, j), 0.0):
                heaviest[i, j] = value
                kinds[i][j] = kind
    cells_by_kind = {
        kind: [[i, j, value] for (i, j), value in sorted(cells.items()) if value]
        for kind, cells in sorted(by_kind.items())
    }
    return {"bytes": total, "kind": kinds, "by_kind": cells_by_kind}
