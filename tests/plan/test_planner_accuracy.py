"""The published runs the planner is checked against: each a layout loom can estimate, on the GPUs its source
used, named by its source; Korthikanti et al. and torchtitan held out of fitting; and the benchmark's report.

The accuracy goal itself is not asserted here: it is the target of calibrating the planner."""

import json

import pytest

from benchmarks import planner_accuracy
from benchmarks.published_runs import NOT_EXPRESSIBLE, PUBLISHED_RUNS
from trainer.plan.estimate import parse_plan


@pytest.mark.parametrize("run", PUBLISHED_RUNS, ids=lambda run: run.name)
def test_a_case_is_a_valid_layout_on_the_sources_gpus(run):
    config, cluster = parse_plan(run.document, run.cluster)
    assert config.parallel.world_size == cluster.world_size == run.gpus
    assert run.published_step_s > 0


def test_every_case_names_its_source_and_set():
    names = [run.name for run in PUBLISHED_RUNS] + [case.name for case in NOT_EXPRESSIBLE]
    assert len(names) == len(set(names))
    for run in PUBLISHED_RUNS:
        assert run.source.strip() and run.step_from.strip()
        assert run.fitting in ("calibration", "held-out")
        assert run.runtime in ("megatron", "torchtitan")
    for case in NOT_EXPRESSIBLE:
        assert case.source.strip() and case.reason.strip()


def test_korthikanti_and_torchtitan_are_held_out():
    held_out = [run for run in PUBLISHED_RUNS if run.fitting == "held-out"]
    calibration = [run for run in PUBLISHED_RUNS if run.fitting == "calibration"]
    assert any("2205.05198" in run.source for run in held_out)
    assert any("torchtitan" in run.source for run in held_out)
    assert not any("2205.05198" in run.source or "torchtitan" in run.source for run in calibration)
    assert len(calibration) >= 10 and len(held_out) >= 5


def test_the_benchmark_reports_each_set(capsys, tmp_path):
    written = tmp_path / "accuracy.json"
    report = planner_accuracy.main(["--json", str(written)])
    printed = capsys.readouterr().out
    for fitting in ("calibration", "held-out"):
        assert any(line.startswith(fitting) and "step time  average |error|" in line for line in printed.splitlines())
    for case in NOT_EXPRESSIBLE:
        assert case.name in printed
    assert json.loads(written.read_text()) == json.loads(json.dumps(report))
    assert len(report["cases"]) == len(PUBLISHED_RUNS)
    assert report["fitting_set"] == "calibration"
