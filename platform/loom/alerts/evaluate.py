"""One pass of the detectors over an attempt: read its recent steps from the tables ingest fills, ask each
detector, and record what they found (services.py).

The steps are read from RankStep (the experts' loads from the metric events), so any web process can judge
any attempt and a restarted one picks up where the last left off; only `judged_through` (the last step the
spike detectors have seen) is the caller's to keep, and losing it means judging a window again, which opens
nothing twice.
"""

import dataclasses
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

from django.db import transaction
from django.db.models import Avg, Count, Max, Min
from django.db.models.functions import Coalesce

from loom.runs.models import Attempt
from loom.telemetry.models import Event, RankStep
from trainer.config import AlertsConfig, ParallelConfig

from . import detectors
from .detectors import StepRow
from .services import Changes, clear_stale, host_lookup, record

# The most steps read back to judge a drop over throughput_drop_min_s (steps of a few milliseconds).
DROP_STEPS_MAX = 2000


@dataclass(frozen=True)
class Pass:
    changes: Changes
    judged_through: int


def alerts_config(attempt: Attempt) -> AlertsConfig:
    return AlertsConfig.model_validate(attempt.config.get("alerts", {}))


def evaluate(attempt: Attempt, non_finite_reports: list[tuple[int, int, str, object]], judged_through: int) -> Pass:
    """Judge the attempt's steps after `judged_through` (spikes) and its latest steps (conditions)."""
    config = alerts_config(attempt)
    if not config.enabled:
        return Pass(Changes([], [], []), judged_through)
    rows = _step_rows(attempt, config)
    host = host_lookup(attempt)
    findings = detectors.non_finite(non_finite_reports)
    if rows:
        findings += detectors.loss_spikes(rows, config, judged_through)
        findings += detectors.grad_norm_spikes(rows, config, judged_through)
        findings += detectors.throughput_drop(rows, config)
        findings += detectors.memory_creep(_with_memory_rank(attempt, rows), config)
        findings += _stragglers(attempt, config, host)
        findings += detectors.overfit(_evaluation_rows(attempt, config, judged_through), config)
        routed = expert_rows(attempt, config)
        findings += detectors.expert_collapse(routed, config)
        findings += detectors.expert_imbalance(routed, config)
    latest = max((row.step for row in rows), default=judged_through)
    with transaction.atomic():
        changes = record(attempt, findings, host)
        resolved = clear_stale(attempt, latest, config.clear_after_steps)
    return Pass(Changes(changes.opened, changes.updated, resolved), max(latest, judged_through))


def _step_rows(attempt: Attempt, config: AlertsConfig) -> list[StepRow]:
    """The run-level view of the latest window and the steps a straggler or a drop needs on top; short steps
    need more of them to hold throughput_drop_min_s (up to DROP_STEPS_MAX)."""
    latest = RankStep.objects.filter(attempt=attempt).aggregate(latest=Max("step"))["latest"]
    if latest is None:
        return []
    extra = max(config.throughput_drop_steps, config.straggler_steps)
    first = latest - config.window - extra
    rows = _rows_between(attempt, first, latest)
    times = [row.step_time_s for row in rows if row.step_time_s]
    if times:
        needed = min(DROP_STEPS_MAX, math.ceil(config.throughput_drop_min_s / statistics.median(times)) + 1)
        if needed > extra:
            rows = _rows_between(attempt, latest - config.window - needed, first) + rows
    return rows


def _rows_between(attempt: Attempt, after_step: int, through_step: int) -> list[StepRow]:
    grouped = (
        RankStep.objects.filter(attempt=attempt, step__gt=after_step, step__lte=through_step)
        .values("step")
        .annotate(
            loss=Min(Coalesce("loss_mean", "loss")),
            grad_norm=Max("grad_norm"),
            tokens_per_s=Avg("tokens_per_s"),
            memory_bytes=Max("memory_bytes"),
            step_time_s=Max("step_time_s"),
        )
        .order_by("step")
    )
    return [
        StepRow(
            row["step"],
            row["loss"],
            row["grad_norm"],
            row["tokens_per_s"],
            row["memory_bytes"],
            step_time_s=row["step_time_s"],
        )
        for row in grouped
    ]


def _evaluation_rows(attempt: Attempt, config: AlertsConfig, judged_through: int) -> list[StepRow]:
    """The steps from the first of the latest overfit_evaluations + 1 evaluations through the latest, with
    training loss (one rank's: it is the same on all) and, where evaluated, validation loss; none unless an
    evaluation came after `judged_through` (until one does, what was found stands)."""
    evaluated = list(
        RankStep.objects.filter(attempt=attempt, eval_loss__isnull=False)
        .values("step")
        .annotate(eval_loss=Min("eval_loss"))
        .order_by("-step")[: config.overfit_evaluations + 1]
    )
    if len(evaluated) <= config.overfit_evaluations or evaluated[0]["step"] <= judged_through:
        return []
    first, latest = evaluated[-1]["step"], evaluated[0]["step"]
    eval_loss = {row["step"]: row["eval_loss"] for row in evaluated}
    rank = RankStep.objects.filter(attempt=attempt, step=latest, eval_loss__isnull=False).aggregate(rank=Min("rank"))
    training = (
        RankStep.objects.filter(attempt=attempt, rank=rank["rank"], step__gte=first, step__lte=latest)
        .values_list("step", Coalesce("loss_mean", "loss"))
        .order_by("step")
    )
    return [StepRow(step, loss, eval_loss=eval_loss.get(step)) for step, loss in training]


def expert_rows(attempt: Attempt, config: AlertsConfig) -> list[StepRow]:
    """The latest steps' expert loads, each step's merged from the ranks that reported them (one per pipeline
    stage, each with its own layers), from the metric events themselves (no table projects them); none for a
    dense model or with both expert rules off. Twice the steps the rules need are read, so that a stage whose
    metrics arrive a few steps behind another's still has its spell in range."""
    steps = max(
        config.expert_collapse_steps if config.expert_collapse_share else 0,
        config.expert_imbalance_steps if config.expert_imbalance_ratio else 0,
    )
    # A dense model reports no loads: its metrics are not searched for them on every pass.
    if not steps or attempt.config.get("model", {}).get("experts", 1) == 1:
        return []
    reports = Event.objects.filter(attempt=attempt, kind="metric", step__isnull=False, payload__has_key="experts")
    latest = reports.order_by("-step").values_list("step", flat=True).first()
    if latest is None:
        return []
    merged: dict[int, dict[int, tuple[int, ...]]] = {}
    recent = reports.filter(step__gt=latest - 2 * steps).order_by("step", "rank")
    for step, experts in recent.values_list("step", "payload__experts"):
        layers = merged.setdefault(step, {})
        for layer, load in _layer_loads(experts):
            layers.setdefault(layer, load)
    return [StepRow(step, expert_loads=layers) for step, layers in merged.items() if layers]


def _layer_loads(experts: object) -> Iterator[tuple[int, tuple[int, ...]]]:
    """(layer, tokens per expert) of a metric's `experts`, leaving out whatever is not one: ingest stores any
    JSON a rank sends, and one malformed report must not stop the attempt's every rule from being judged."""
    if not isinstance(experts, dict):
        return
    for layer, routing in experts.items():
        load = routing.get("load") if isinstance(routing, dict) else None
        if not (layer.isdecimal() and isinstance(load, list) and len(load) >= 2):
            continue
        # Counts only: a bool is an int to Python, and a float or a string no count of tokens.
        if set(map(type, load)) == {int} and min(load) >= 0:
            yield int(layer), tuple(load)


def _with_memory_rank(attempt: Attempt, rows: list[StepRow]) -> list[StepRow]:
    """The rows with the last one naming the rank that holds its highest memory."""
    last = rows[-1]
    if last.memory_bytes is None:
        return rows
    rank = (
        RankStep.objects.filter(attempt=attempt, step=last.step, memory_bytes=last.memory_bytes)
        .order_by("rank")
        .values_list("rank", flat=True)
        .first()
    )
    named = dataclasses.replace(last, memory_rank=rank)
    return [*rows[:-1], named]


def _stragglers(attempt: Attempt, config: AlertsConfig, host) -> list[detectors.Finding]:
    """Stragglers judged on the latest straggler_steps steps, then, only for ranks slow in all of them but
    for less than straggler_min_s, on as many steps as that takes, read for their peer groups alone: a pass
    over 1,024 ranks reads a short window unless some rank is slow."""
    parallel = ParallelConfig.model_validate(attempt.config.get("parallel", {}))
    peers = detectors.pipeline_peers(parallel)
    times, measure = _step_times(attempt, config.straggler_steps)
    candidates = detectors.stragglers(times, config.model_copy(update={"straggler_min_s": 0.0}), host, measure, peers)
    found = {finding.rank: finding for finding in candidates if finding.details["seconds"] >= config.straggler_min_s}
    short = [finding for finding in candidates if finding.rank not in found]
    if short:
        steps = min(detectors.straggler_history_needed(short, config), DROP_STEPS_MAX)
        groups = {peers(finding.rank) for finding in short}
        ranks = [rank for rank in range(parallel.world_size) if peers(rank) in groups] if parallel.pp > 1 else None
        times, measure = _step_times(attempt, steps, ranks)
        for finding in detectors.stragglers(times, config, host, measure, peers):
            found.setdefault(finding.rank, finding)
    return [found[rank] for rank in sorted(found)]


def _step_times(
    attempt: Attempt, steps: int, ranks: list[int] | None = None
) -> tuple[dict[int, dict[int, float]], str]:
    """Each rank's own time (of `ranks`, else all) in the latest `steps` steps every one of them has reported,
    and what it is. A rank's own time is its compute time where every rank of the step measured one (the
    others' waits for a slow rank are in their collectives, so their whole step times match the slow rank's),
    else its step time."""
    rows = RankStep.objects.filter(attempt=attempt)
    if ranks is not None:
        rows = rows.filter(rank__in=ranks)
    counts = list(
        rows.values("step").annotate(ranks=Count("id"), computed=Count("compute_s")).order_by("-step")[: steps * 2 + 1]
    )
    if not counts:
        return {}, ""
    world = max(row["ranks"] for row in counts)
    complete = [row for row in counts if row["ranks"] == world][:steps]
    use_compute = all(row["computed"] == row["ranks"] for row in complete)
    column = "compute_s" if use_compute else "step_time_s"
    times: dict[int, dict[int, float]] = {}
    for step, rank, seconds in rows.filter(step__in=[row["step"] for row in complete]).values_list(
        "step", "rank", column
    ):
        if seconds is not None:
            times.setdefault(step, {})[rank] = seconds
    return times, "compute time" if use_compute else "step time"
