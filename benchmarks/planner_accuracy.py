"""How close the planner's step time and peak memory come to published training runs.

    .venv/bin/python benchmarks/planner_accuracy.py
    .venv/bin/python benchmarks/planner_accuracy.py --json accuracy.json

Runs every case of benchmarks/published_runs.py (Megatron-LM, NeMo and Megatron-Bridge runs through the planner's
"megatron" runtime, torchtitan runs through its "torchtitan" runtime) through trainer.plan.estimate.estimate and prints
one line per case: published and estimated seconds per optimizer step and the error, and, where the source gives
one, published and estimated peak memory and its error. Then, for the calibration set (whose cases may be used
to fit the planner's constants) and the held-out set (which must never be), the average and worst |error| of step
time and of memory, and which set fitting may use. Cases the planner cannot express are listed with the reason.
Runs in seconds on a CPU.

The goal: on the held-out cases, average |error| at most 5 % and worst at most 10 %, for step time and memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.published_runs import NOT_EXPRESSIBLE, PUBLISHED_RUNS, PublishedRun  # noqa: E402
from trainer.plan.estimate import estimate  # noqa: E402

GIB = 2**30
FITTING_SETS = ("calibration", "held-out")
GOAL_AVERAGE, GOAL_WORST = 0.05, 0.10


@dataclass(frozen=True)
class Comparison:
    run: PublishedRun
    estimated_step_s: float
    estimated_reserved_gib: float

    @property
    def step_error(self) -> float:
        """Signed relative error of the estimate: positive when the planner says slower than measured."""
        return self.estimated_step_s / self.run.published_step_s - 1

    @property
    def memory_error(self) -> float | None:
        published = self.run.published_reserved_gib
        return None if published is None else self.estimated_reserved_gib / published - 1

    def to_json(self) -> dict:
        run = self.run
        return {
            "name": run.name,
            "fitting": run.fitting,
            "runtime": run.runtime,
            "gpu": run.cluster["gpu"],
            "gpus": run.gpus,
            "source": run.source,
            "step_from": run.step_from,
            "assumed": list(run.assumed),
            "published_step_s": run.published_step_s,
            "estimated_step_s": self.estimated_step_s,
            "step_error": self.step_error,
            "published_reserved_gib": run.published_reserved_gib,
            "estimated_reserved_gib": self.estimated_reserved_gib,
            "memory_error": self.memory_error,
        }


def compare(run: PublishedRun) -> Comparison:
    result = estimate(run.document, run.cluster, runtime=run.runtime, attention=run.attention, timeline=True)
    return Comparison(run, result.step_s, result.peak.reserved_bytes / GIB)


def summary(errors: list[tuple[str, float]]) -> dict | None:
    """Average and worst |error| over (name, error) pairs; None when the set has none."""
    if not errors:
        return None
    worst_name, worst = max(errors, key=lambda item: abs(item[1]))
    return {
        "cases": len(errors),
        "average_abs_error": sum(abs(error) for _, error in errors) / len(errors),
        "worst_abs_error": abs(worst),
        "worst_case": worst_name,
    }


def summaries(comparisons: list[Comparison]) -> dict:
    by_set = {}
    for fitting in FITTING_SETS:
        chosen = [c for c in comparisons if c.run.fitting == fitting]
        by_set[fitting] = {
            "step_time": summary([(c.run.name, c.step_error) for c in chosen]),
            "memory": summary([(c.run.name, c.memory_error) for c in chosen if c.memory_error is not None]),
        }
    return by_set


def case_line(comparison: Comparison) -> str:
    run = comparison.run
    line = (
        f"{run.name:<44} {run.fitting:<11} {run.cluster['gpu']:<9} {run.gpus:>5} "
        f"{run.published_step_s:>9.3f} {comparison.estimated_step_s:>9.3f} {comparison.step_error:>+7.1%}"
    )
    if comparison.memory_error is not None:
        line += (
            f"   {run.published_reserved_gib:>6.1f} {comparison.estimated_reserved_gib:>6.1f} "
            f"{comparison.memory_error:>+7.1%}"
        )
    return line


def summary_line(fitting: str, quantity: str, numbers: dict | None) -> str:
    if numbers is None:
        return f"{fitting:<11} {quantity:<9}  no published figures"
    return (
        f"{fitting:<11} {quantity:<9}  average |error| {numbers['average_abs_error']:6.1%} over {numbers['cases']} "
        f"cases, worst {numbers['worst_abs_error']:6.1%} ({numbers['worst_case']})"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write every case and the summaries to this file")
    args = parser.parse_args(argv)

    comparisons = [compare(run) for run in PUBLISHED_RUNS]
    print(
        f"{'case':<44} {'set':<11} {'gpu':<9} {'gpus':>5} {'pub s':>9} {'est s':>9} {'error':>7}"
        f"   {'pub GiB':>6} {'est GiB':>6} {'error':>7}"
    )
    for comparison in comparisons:
        print(case_line(comparison))
    print()
    print("not expressible in loom's run config (not estimated):")
    for case in NOT_EXPRESSIBLE:
        print(f"  {case.name}: {case.reason}")
    print()
    by_set = summaries(comparisons)
    for fitting in FITTING_SETS:
        for quantity, key in (("step time", "step_time"), ("memory", "memory")):
            print(summary_line(fitting, quantity, by_set[fitting][key]))
    print(
        "fitting may use the calibration set only; the goal, on the held-out set: average |error| ≤ "
        f"{GOAL_AVERAGE:.0%}, worst ≤ {GOAL_WORST:.0%}"
    )

    report = {
        "fitting_set": "calibration",
        "goal": {"held_out_average_abs_error": GOAL_AVERAGE, "held_out_worst_abs_error": GOAL_WORST},
        "cases": [comparison.to_json() for comparison in comparisons],
        "not_expressible": [{"name": c.name, "source": c.source, "reason": c.reason} for c in NOT_EXPRESSIBLE],
        "summaries": by_set,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
