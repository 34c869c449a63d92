"""`python -m trainer.plan` as a user runs it: estimate, search and export, and bad input refused
with exit status 2 and the field named."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYOUT = {
    "model": {"preset": "llama3-70b"},
    "parallel": {
        "tp": 8,
        "pp": 4,
        "pp_schedule": "Interleaved1F1B",
        "stages_per_rank": 2,
        "microbatches": 8,
        "dp_shard": 2,
    },
    "data": {"micro_batch": 256},
    "compute": {"recompute": "selective"},
}


def plan(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.plan", *arguments], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def layout_file(tmp_path) -> Path:
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(LAYOUT))
    return path


def test_estimate_prints_memory_time_throughput_communication_and_warnings(layout_file):
    answer = plan("estimate", str(layout_file), "--gpu", "H100-SXM", "--nodes", "8", "--gpus-per-node", "8")
    assert answer.returncode == 0, answer.stderr
    out = answer.stdout
    for heading in (
        "Memory per GPU, GiB",
        "pp rank 3",
        "activations",
        "Step time",
        "pipeline bubble",
        "tokens/s",
        "MFU",
        "Communication per kind",
        "Warnings",
        "does not fit",
    ):
        assert heading in out, heading


def test_estimate_json_is_the_estimate_without_its_timeline(layout_file, tmp_path):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"gpu": "H100-SXM", "nodes": 2}))
    answer = plan("estimate", str(layout_file), "--cluster", str(cluster), "--nodes", "8", "--json")
    assert answer.returncode == 0, answer.stderr
    document = json.loads(answer.stdout)
    assert document["timeline"] is None
    assert document["cluster"]["nodes"] == 8
    assert document["layout"]["world_size"] == 64
    assert {"memory", "time", "tokens_per_s", "mfu", "comm", "warnings"} <= set(document)


def test_estimate_prices_the_layout_for_the_runtime_named(layout_file):
    exposed = {}
    for runtime in ("loom", "megatron"):
        answer = plan("estimate", str(layout_file), "--gpu", "H100-SXM", "--nodes", "8", "--runtime", runtime, "--json")
        assert answer.returncode == 0, answer.stderr
        terms = {term["name"]: term["value"] for term in json.loads(answer.stdout)["time"]["terms"]}
        exposed[runtime] = terms["exposed tp/cp/ep communication"]
    # Megatron hides its backward tp collectives under the weight gradients; loom's trainer does not.
    assert 0 < exposed["megatron"] < exposed["loom"]
    assert plan("estimate", str(layout_file), "--runtime", "deepspeed").returncode == 2


def test_search_json_lists_fitting_layouts_and_the_frontier():
    answer = plan(
        "search",
        "--model",
        "llama3-70b",
        "--gpu",
        "H100-SXM",
        "--nodes",
        "8",
        "--global-batch",
        "512",
        "--limit",
        "5",
        "--json",
    )
    assert answer.returncode == 0, answer.stderr
    document = json.loads(answer.stdout)
    assert len(document["results"]) == 5 and document["pareto"]
    assert all(entry["config"]["parallel"]["tp"] >= 1 for entry in document["results"])
    assert document["fitting"] > 0


def test_search_prints_tables_and_takes_a_model_file(tmp_path):
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": {"preset": "llama3-8b", "layers": 8}}))
    answer = plan("search", "--model", str(model), "--nodes", "1", "--global-batch", "16", "--limit", "3")
    assert answer.returncode == 0, answer.stderr
    assert "Fastest layouts that fit" in answer.stdout and "Pareto frontier" in answer.stdout
    assert "layouts evaluated" in answer.stdout


def test_search_runnable_only_lists_only_what_the_trainer_runs():
    answer = plan("search", "--model", "llama3-8b", "--nodes", "1", "--global-batch", "16", "--runnable-only", "--json")
    assert answer.returncode == 0, answer.stderr
    document = json.loads(answer.stdout)
    assert document["results"] and all(entry["runnable"] for entry in document["results"] + document["pareto"])


def test_export_prints_a_torchtitan_job_and_megatron_arguments(layout_file):
    toml = plan("export", str(layout_file), "--format", "torchtitan")
    assert toml.returncode == 0, toml.stderr
    assert tomllib.loads(toml.stdout)["parallelism"]["pipeline_parallel_degree"] == 4
    arguments = plan("export", str(layout_file), "--format", "megatron")
    assert arguments.returncode == 0, arguments.stderr
    assert "--pipeline-model-parallel-size=4 \\" in arguments.stdout.splitlines()


def test_invalid_input_exits_2_naming_each_field(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"model": {"preset": "llama3-70b"}, "parallel": {"tp": 3}}))
    answer = plan("estimate", str(broken), "--nodes", "0")
    assert answer.returncode == 2
    fields = {line.split(":", 1)[0] for line in answer.stderr.splitlines()}
    assert {"parallel.tp", "cluster.nodes"} <= fields
    assert answer.stdout == ""


def test_an_export_without_equivalent_exits_2(tmp_path):
    gpipe = tmp_path / "gpipe.json"
    gpipe.write_text(
        json.dumps(
            {
                "model": {"preset": "llama3-70b"},
                "data": {"micro_batch": 8},
                "parallel": {"pp": 4, "pp_schedule": "GPipe", "microbatches": 8},
            }
        )
    )
    answer = plan("export", str(gpipe), "--format", "megatron")
    assert answer.returncode == 2
    assert answer.stderr.startswith("parallel.pp_schedule: Megatron-LM runs 1F1B and interleaved 1F1B only")


def test_a_missing_file_and_a_bad_search_exit_2(tmp_path):
    missing = plan("estimate", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and missing.stderr.startswith("config: cannot read")
    search = plan("search", "--model", "llama3-70b", "--global-batch", "0")
    assert search.returncode == 2 and search.stderr.startswith("global_batch:")


def test_estimate_of_a_bare_preset_takes_and_prints_the_planning_defaults(tmp_path):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"model": {"preset": "llama3-8b"}}))
    answer = plan("estimate", str(bare))
    assert answer.returncode == 0, answer.stderr
    (line,) = [line for line in answer.stdout.splitlines() if line.startswith("Planning defaults")]
    for taken in ("compute.recompute = selective", "data.micro_batch = 1", "parallel.dp_shard = 8"):
        assert taken in line
    assert re.search(r"^Memory per GPU, GiB — usable 78\.61 of 79\.65, headroom \d+\.\d\d: fits$", answer.stdout, re.M)
    assert "NCCL buffers: 0.29 GiB" in answer.stdout
    document = json.loads(plan("estimate", str(bare), "--json").stdout)
    assert document["defaults"]["parallel.dp_shard"] == 8
    assert document["config"]["data"]["micro_batch"] == 1 and document["memory"]["fits"]


def test_a_stated_layout_is_not_widened_by_the_defaults(layout_file):
    document = json.loads(plan("estimate", str(layout_file), "--nodes", "8", "--json").stdout)
    assert document["defaults"] == {"compute.precision": "bf16"}
    assert document["layout"]["world_size"] == 64 and document["config"]["data"]["micro_batch"] == 256


def test_an_unknown_preset_names_the_presets():
    answer = plan("search", "--model", "llama3-71b", "--global-batch", "8")
    assert answer.returncode == 2
    assert answer.stderr.startswith("model: 'llama3-71b' is neither a preset")
    assert "llama3-70b" in answer.stderr and "cannot read" not in answer.stderr


def test_a_reader_that_stops_early_ends_the_output_quietly():
    """As `… | head -3` does: the pipe is closed before the planner writes its answer."""
    search = subprocess.Popen(
        [sys.executable, "-m", "trainer.plan", "search", "--model", "llama3-8b", "--global-batch", "16"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    search.stdout.close()
    errors = search.stderr.read()
    assert search.wait(timeout=300) == 0
    assert errors == ""


def test_export_warns_on_stderr_and_prints_only_the_job(layout_file):
    answer = plan("export", str(layout_file), "--format", "torchtitan")
    assert answer.returncode == 0, answer.stderr
    assert tomllib.loads(answer.stdout)["optimizer"]["lr"] == 0.003
    assert "warning: optimizer.lr: lr 0.003 is loom's demo default" in answer.stderr
