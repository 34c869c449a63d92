"""A run's resilience figures from its real events: what each failure cost and how often to save.

- RPO, per failure: steps trained and lost — the failed attempt's last step minus the step the
  restart resumed from.
- RTO, per failure: seconds from the failure being recorded (the launcher's `failed` state) to the
  first step the next attempt reported.
- ETTR: the time spent on steps that were kept, over the run's wall time (first start to last event).
- Checkpoint stall: seconds training was blocked per save.
- Young/Daly: the save interval that minimises expected lost time, √(2 · MTBF · C), with C the stall
  per save and MTBF the run's wall time per failure so far (no advice before the first failure).
"""

import math
import statistics
from dataclasses import dataclass

from loom.runs.models import Attempt, Run
from loom.telemetry.models import Event

from .models import Checkpoint

REPORTING_RANK = 0


@dataclass(frozen=True)
class StepRecord:
    step: int
    time: float
    step_time_s: float


def steps_by_attempt(run: Run) -> dict[int, list[StepRecord]]:
    """Rank 0's metric events per attempt, by step."""
    found: dict[int, list[StepRecord]] = {}
    rows = Event.objects.filter(run=run, kind="metric", rank=REPORTING_RANK).values_list(
        "attempt_id", "step", "time", "payload"
    )
    for attempt_id, step, when, payload in rows:
        step_time = payload.get("step_time_s")
        record = StepRecord(step, when.timestamp(), step_time if isinstance(step_time, (int, float)) else 0.0)
        found.setdefault(attempt_id, []).append(record)
    for records in found.values():
        records.sort(key=lambda record: record.step)
    return found


def resumed_step(attempt: Attempt) -> int:
    return attempt.restored_from.step if attempt.restored_from_id is not None else 0


def failures_of(attempts: list[Attempt], steps: dict[int, list[StepRecord]]) -> list[dict]:
    """Each failed attempt that an automatic restart followed, with what it cost."""
    found = []
    for failed, restart in zip(attempts, attempts[1:], strict=False):
        if failed.state != "failed" or restart.trigger != Attempt.RESTART:
            continue
        failed_steps, restart_steps = steps.get(failed.pk, []), steps.get(restart.pk, [])
        last_step = failed_steps[-1].step if failed_steps else resumed_step(failed)
        first = restart_steps[0] if restart_steps else None
        detected = failed.finished_at.timestamp() if failed.finished_at else None
        found.append(
            {
                "attempt": failed.number,
                "kind": failed.failure_kind,
                "last_step": last_step,
                "resumed_step": resumed_step(restart),
                "rpo_steps": max(0, last_step - resumed_step(restart)),
                "rto_s": first.time - detected if first is not None and detected is not None else None,
                "restart_attempt": restart.number,
            }
        )
    return found


def productive_seconds(attempts: list[Attempt], steps: dict[int, list[StepRecord]]) -> float:
    """Step time of the steps that were kept: an attempt's steps past where its successor resumed
    were trained again, so they count as lost."""
    total = 0.0
    for index, attempt in enumerate(attempts):
        successor = attempts[index + 1] if index + 1 < len(attempts) else None
        kept_up_to = resumed_step(successor) if successor is not None else math.inf
        total += sum(record.step_time_s for record in steps.get(attempt.pk, []) if record.step <= kept_up_to)
    return total


def young_daly_interval_s(mtbf_s: float, save_cost_s: float) -> float:
    return math.sqrt(2.0 * mtbf_s * save_cost_s)


def resilience(run: Run) -> dict:
    attempts = list(run.attempts.select_related("restored_from").order_by("number"))
    steps = steps_by_attempt(run)
    failures = failures_of(attempts, steps)
    failed_count = sum(1 for attempt in attempts if attempt.state == "failed")
    starts = [attempt.started_at.timestamp() for attempt in attempts if attempt.started_at]
    ends = [records[-1].time for records in steps.values() if records]
    ends += [attempt.finished_at.timestamp() for attempt in attempts if attempt.finished_at]
    wall_s = max(ends) - min(starts) if starts and ends and max(ends) > min(starts) else None
    productive_s = productive_seconds(attempts, steps)
    stalls = list(
        Checkpoint.objects.filter(run=run, stall_s__isnull=False).order_by("step").values_list("stall_s", flat=True)
    )
    step_times = [record.step_time_s for records in steps.values() for record in records if record.step_time_s > 0]
    step_time_s = statistics.median(step_times) if step_times else None
    config = attempts[-1].config if attempts else run.config
    interval_steps = config.get("checkpoint", {}).get("interval_steps", 0)
    advice = None
    if failed_count and wall_s and stalls:
        mtbf_s = wall_s / failed_count
        optimum_s = young_daly_interval_s(mtbf_s, statistics.median(stalls))
        advice = {
            "mtbf_s": mtbf_s,
            "save_cost_s": statistics.median(stalls),
            "interval_s": optimum_s,
            "interval_steps": max(1, round(optimum_s / step_time_s)) if step_time_s else None,
        }
    rtos = [failure["rto_s"] for failure in failures if failure["rto_s"] is not None]
    return {
        "failures": failures,
        "failed_attempts": failed_count,
        "restarts": sum(1 for attempt in attempts if attempt.trigger == Attempt.RESTART),
        "rpo_steps_mean": statistics.mean(f["rpo_steps"] for f in failures) if failures else None,
        "rto_s_mean": statistics.mean(rtos) if rtos else None,
        "wall_s": wall_s,
        "productive_s": productive_s,
        "ettr": min(1.0, productive_s / wall_s) if wall_s else None,
        "checkpoint_stall_s": {
            "saves": len(stalls),
            "mean": statistics.mean(stalls) if stalls else None,
            "max": max(stalls) if stalls else None,
            "total": sum(stalls),
        },
        "step_time_s": step_time_s,
        "configured_interval_steps": interval_steps,
        "configured_interval_s": interval_steps * step_time_s if interval_steps and step_time_s else None,
        "young_daly": advice,
    }
