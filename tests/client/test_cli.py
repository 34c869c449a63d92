"""The command line without a platform: what it reads, what it refuses, and the status it exits with."""

import json
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from loom_client.cli import app, new_lines, restore_changes
from loom_client.client import ApiError
from loom_client.credentials import credentials_path
from loom_client.documents import DocumentError
from loom_client.exit_codes import BAD_INPUT, FAILED, reports_errors
from tests.deployment import free_port

runner = CliRunner()


@pytest.fixture(autouse=True)
def nobody_logged_in(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("LOOM_URL", raising=False)
    monkeypatch.delenv("LOOM_TOKEN", raising=False)


def test_an_unreadable_or_invalid_file_exits_2_naming_it_before_asking_the_platform(tmp_path):
    missing = runner.invoke(app, ["run", "submit", str(tmp_path / "absent.yaml")])
    assert missing.exit_code == BAD_INPUT
    assert f"{tmp_path / 'absent.yaml'}: cannot read it" in missing.stderr

    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  layers: [2\n")
    invalid = runner.invoke(app, ["run", "submit", str(broken)])
    assert invalid.exit_code == BAD_INPUT
    assert f"{broken}: invalid YAML" in invalid.stderr


def test_a_bad_set_exits_2(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("steps: 3\n")
    answer = runner.invoke(app, ["run", "submit", str(config), "--set", "parallel..tp=2"])
    assert answer.exit_code == BAD_INPUT
    assert "'parallel..tp' is not a dotted path" in answer.stderr
    through_a_value = runner.invoke(app, ["run", "submit", str(config), "--set", "steps.every=2"])
    assert (through_a_value.exit_code, through_a_value.stderr.strip()) == (
        BAD_INPUT,
        "--set steps.every: steps is 3, not a section with fields to set",
    )


def test_a_restore_changes_only_what_the_restore_api_takes():
    assert restore_changes({"parallel.dp_shard": 2, "parallel.dp_replicate": 1, "steps": 40, "optimizer.lr": 1e-4}) == {
        "parallel": {"dp_shard": 2, "dp_replicate": 1},
        "steps": 40,
        "lr": 1e-4,
    }
    with pytest.raises(DocumentError, match="model.dim: a restore changes parallel.<field>, steps and optimizer.lr"):
        restore_changes({"model.dim": 128})
    answer = runner.invoke(app, ["restore", "7", "--step", "5", "--set", "model.dim=128"])
    assert answer.exit_code == BAD_INPUT and "a restore changes parallel.<field>" in answer.stderr


def test_without_credentials_a_command_says_how_to_log_in_and_exits_1():
    answer = runner.invoke(app, ["runs"])
    assert answer.exit_code == FAILED
    assert "not logged in: run `loom login URL`" in answer.stderr


def test_an_unreachable_platform_exits_1_and_login_saves_nothing():
    url = f"http://127.0.0.1:{free_port()}"
    answer = runner.invoke(app, ["login", url, "--token", "loom_anything"])
    assert answer.exit_code == FAILED
    assert f"cannot reach the platform at {url}" in answer.stderr
    assert not credentials_path().exists()


@pytest.mark.parametrize(
    ("status", "code"), [(400, BAD_INPUT), (422, BAD_INPUT), (401, FAILED), (404, FAILED), (409, FAILED), (500, FAILED)]
)
def test_an_api_refusal_prints_each_field_on_its_own_line_and_exits_by_status(status, code):
    refusing = typer.Typer()

    @refusing.command()
    @reports_errors
    def refused():
        errors = {"config.model.heads": "must divide dim=64", "name": "is required"}
        raise ApiError(status, errors, "POST", "/api/runs")

    answer = runner.invoke(refusing, [])
    assert answer.exit_code == code
    assert answer.stderr.splitlines() == ["config.model.heads: must divide dim=64", "name: is required"]


def test_a_tail_shows_only_what_the_previous_tail_did_not():
    assert new_lines([], ["a", "b"]) == ["a", "b"]
    assert new_lines(["a", "b", "c"], ["b", "c", "d", "e"]) == ["d", "e"]
    assert new_lines(["a", "b"], ["a", "b"]) == []
    # Scrolled past everything shown before: all of it is new.
    assert new_lines(["a", "b"], ["x", "y"]) == ["x", "y"]


def test_plan_commands_run_the_planner_locally_on_yaml(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {preset: llama3-8b}\nparallel: {tp: 8}\n")
    estimate = runner.invoke(app, ["plan", "estimate", str(config), "--gpu", "H100-SXM", "--nodes", "1"])
    assert estimate.exit_code == 0, estimate.output
    assert "Memory per GPU, GiB" in estimate.stdout and "Throughput:" in estimate.stdout

    as_json = runner.invoke(app, ["plan", "estimate", str(config), "--gpu", "H100-SXM", "--nodes", "1", "--json"])
    assert json.loads(as_json.stdout)["config"]["parallel"]["tp"] == 8

    exported = runner.invoke(app, ["plan", "export", str(config), "--format", "megatron"])
    assert exported.exit_code == 0 and "--tensor-model-parallel-size" in exported.stdout

    found = runner.invoke(
        app, ["plan", "search", "--model", "llama3-8b", "--gpu", "H100-SXM", "--nodes", "1", "--global-batch", "16"]
    )
    assert found.exit_code == 0 and "Fastest layouts that fit" in found.stdout


def test_a_plan_the_rules_refuse_exits_2_with_its_fields(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {preset: llama3-8b, heads: 7}\n")
    answer = runner.invoke(app, ["plan", "estimate", str(config), "--gpu", "H100-SXM"])
    assert answer.exit_code == BAD_INPUT
    assert answer.stderr.startswith("model.")


def test_the_client_imports_nothing_of_the_platform_nor_torch():
    code = (
        "import sys, loom_client.cli; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'django', 'celery', 'channels', 'loom', 'torch'}))"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert found.stdout.strip() == "[]"
