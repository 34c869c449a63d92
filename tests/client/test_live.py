"""The command line and the Python client against a real platform: uvicorn, Celery workers, PostgreSQL and
Redis of this module's own (tests/deployment.py), and real torchrun ranks. One run trains (and trains again
from a checkpoint in another layout); the others are cancelled as soon as they are created."""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from loom_client import ApiError, LoomClient
from loom_client.cli import app

from ..deployment import private_deployment
from ..platform.helpers import TINY_CONFIG

pytestmark = pytest.mark.slow

STEPS = 12
CHECKPOINT_EVERY = 5
TRAINING = {**TINY_CONFIG, "steps": STEPS, "checkpoint": {"interval_steps": CHECKPOINT_EVERY}}
runner = CliRunner()


@pytest.fixture(scope="module")
def deployment():
    with private_deployment() as running:
        yield running


@pytest.fixture(scope="module")
def loom(deployment, tmp_path_factory):
    """Run `loom ARGS…` in this process, logged in through the environment, as CI would."""
    environment = {
        "LOOM_URL": deployment.url,
        "LOOM_TOKEN": deployment.token,
        "XDG_CONFIG_HOME": str(tmp_path_factory.mktemp("config")),
    }
    return lambda *arguments, **overrides: runner.invoke(app, list(arguments), env={**environment, **overrides})


@pytest.fixture(scope="module")
def client(deployment):
    with LoomClient(deployment.url, deployment.token) as connected:
        yield connected


def submitted_id(output: str) -> int:
    return int(re.search(r"^run (\d+) ", output, re.MULTILINE).group(1))


def table_row(output: str, attempt: int, step: int) -> re.Match | None:
    """`run watch`'s row of a step: attempt, step, loss, tokens/s."""
    return re.search(rf"^\W*{attempt}\W+{step}\W+(\d+\.\d{{4}})\W+([\d,]+)\b", output, re.MULTILINE)


@pytest.fixture(scope="module")
def trained(loom, tmp_path_factory):
    """A run submitted from a YAML file and watched to its end: (its id, what `run watch` printed)."""
    config_file = tmp_path_factory.mktemp("configs") / "tiny.yaml"
    config_file.write_text(yaml.safe_dump(TRAINING))
    submitted = loom("run", "submit", str(config_file), "--name", "cli live")
    assert submitted.exit_code == 0, submitted.output
    run_id = submitted_id(submitted.stdout)
    watched = loom("run", "watch", str(run_id))
    return run_id, watched


def test_a_yaml_file_submitted_and_watched_to_its_end(trained, client):
    run_id, watched = trained
    assert watched.exit_code == 0, watched.output
    assert f"run {run_id} cli live: succeeded" in watched.stdout
    assert table_row(watched.stdout, attempt=1, step=STEPS), watched.stdout
    assert f"{STEPS}/{STEPS}" in watched.stdout
    run = client.run(run_id)
    assert (run.state, run.config["steps"], run.config["checkpoint"]["interval_steps"]) == ("succeeded", 12, 5)


def test_show_and_logs_of_rank_0(trained, loom):
    run_id, _ = trained
    shown = loom("run", "show", str(run_id))
    assert shown.exit_code == 0 and "succeeded" in shown.stdout and "dp_replicate 2" in shown.stdout
    logs = loom("logs", str(run_id), "--rank", "0", "--lines", "50")
    assert logs.exit_code == 0, logs.output
    assert f"rank 0 step {STEPS}/{STEPS} loss" in logs.stdout
    # Following an attempt that has ended prints its tail once and returns.
    followed = loom("logs", str(run_id), "--attempt", "1", "--rank", "1", "-f")
    assert followed.exit_code == 0 and f"rank 1 step {STEPS}/{STEPS}" in followed.stdout
    absent = loom("logs", str(run_id), "--rank", "7")
    assert (absent.exit_code, absent.stderr.strip()) == (1, "url: no such attempt or rank")


def test_checkpoints_then_a_restore_into_another_layout_trains_on(trained, loom, client):
    run_id, _ = trained
    listed = loom("checkpoints", str(run_id))
    assert listed.exit_code == 0, listed.output
    committed = {checkpoint.step for checkpoint in client.checkpoints(run_id) if checkpoint.state == "committed"}
    assert {CHECKPOINT_EVERY, 2 * CHECKPOINT_EVERY} <= committed
    row = rf"^\W*{CHECKPOINT_EVERY}\W+1\W+committed\W+dp_replicate 2\W+\d+\.\d{{4}}\b"
    assert re.search(row, listed.stdout, re.MULTILINE), listed.stdout

    nowhere = loom("restore", str(run_id), "--step", "7")
    assert nowhere.exit_code == 2 and "no committed checkpoint at step 7" in nowhere.output

    restored = loom(
        "restore", str(run_id), "--step", str(CHECKPOINT_EVERY),
        "--set", "parallel.dp_replicate=1", "--set", "parallel.dp_shard=2",
    )  # fmt: skip
    assert restored.exit_code == 0, restored.output
    assert f"run {run_id}: attempt 2 queued from step {CHECKPOINT_EVERY}" in restored.stdout
    watched = loom("run", "watch", str(run_id))
    assert watched.exit_code == 0, watched.output
    assert table_row(watched.stdout, attempt=2, step=STEPS), watched.stdout
    second = client.run(run_id).latest_attempt
    assert (second.number, second.state, second.restored_from_step) == (2, "succeeded", CHECKPOINT_EVERY)
    assert (second.parallel["dp_replicate"], second.parallel["dp_shard"]) == (1, 2)


def test_config_get_submitted_again_gives_the_same_config_and_cancelled_runs_exit_3(trained, loom, client, tmp_path):
    run_id, _ = trained
    printed = loom("config", "get", str(run_id))
    assert printed.exit_code == 0, printed.output
    copy = tmp_path / "copy.yaml"
    copy.write_text(printed.stdout)
    submitted = loom("run", "submit", str(copy))
    assert submitted.exit_code == 0, submitted.output
    copy_id = submitted_id(submitted.stdout)
    assert loom("run", "cancel", str(copy_id)).exit_code == 0
    assert client.config(copy_id) == client.config(run_id)
    assert client.run(copy_id).name == "copy"

    cloned = loom("run", "clone", str(copy_id), "--name", "shorter", "--set", "steps=3")
    assert cloned.exit_code == 0, cloned.output
    clone_id = submitted_id(cloned.stdout)
    client.cancel(clone_id)
    assert client.config(clone_id) == {**client.config(run_id), "steps": 3}

    watched = loom("run", "watch", str(copy_id))
    assert watched.exit_code == 3, watched.output
    assert "cancelled" in watched.stdout


def test_an_invalid_config_prints_the_fields_the_api_refused_and_exits_2(loom, client, tmp_path):
    before = len(list(client.runs()))
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump({**TRAINING, "model": {**TRAINING["model"], "heads": 5}, "steps": 0}))
    refused = loom("run", "submit", str(broken))
    assert refused.exit_code == 2
    lines = refused.stderr.splitlines()
    assert any(line.startswith("config.model.heads: ") for line in lines), refused.stderr
    assert any(line.startswith("config.steps: ") for line in lines), refused.stderr
    assert len(list(client.runs())) == before


def test_a_bad_token_is_refused_over_http_and_over_the_websocket(trained, loom, deployment):
    run_id, _ = trained
    refused = loom("runs", LOOM_TOKEN="loom_not-a-token")
    assert refused.exit_code == 1
    assert refused.stderr.startswith("authorization: send a valid API token")
    with LoomClient(deployment.url, "loom_not-a-token") as stranger, pytest.raises(ApiError) as closed:
        next(stranger.watch(run_id))
    assert closed.value.status == 403 and "refused the run's websocket" in closed.value.errors["websocket"]


def test_login_checks_the_token_before_saving_it(loom, deployment, tmp_path):
    config_home = tmp_path / "config"
    refused = loom("login", deployment.url, "--token", "loom_not-a-token", XDG_CONFIG_HOME=str(config_home))
    assert refused.exit_code == 1 and not (config_home / "loom" / "credentials.json").exists()
    logged_in = loom("login", deployment.url, "--token", deployment.token, XDG_CONFIG_HOME=str(config_home),
                     LOOM_URL="", LOOM_TOKEN="")  # fmt: skip
    assert logged_in.exit_code == 0, logged_in.output
    saved = config_home / "loom" / "credentials.json"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    listed = loom("runs", XDG_CONFIG_HOME=str(config_home), LOOM_URL="", LOOM_TOKEN="")
    assert listed.exit_code == 0, listed.output


def test_the_installed_command_lists_runs_by_state_and_name(trained, deployment, tmp_path):
    run_id, _ = trained
    command = Path(sys.executable).parent / "loom"
    environment = {**os.environ, "LOOM_URL": deployment.url, "LOOM_TOKEN": deployment.token,
                   "XDG_CONFIG_HOME": str(tmp_path), "COLUMNS": "200"}  # fmt: skip
    listed = subprocess.run(
        [str(command), "runs", "--state", "succeeded", "--search", "LIVE"],
        env=environment, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert re.search(rf"^\W*{run_id}\W+cli live\W+succeeded\b", listed.stdout, re.MULTILINE), listed.stdout
    assert "copy" not in listed.stdout


def test_a_run_tagged_is_found_by_its_tag_and_an_archived_one_leaves_the_list(trained, loom, client):
    run_id, _ = trained
    tagged = loom("run", "tag", str(run_id), "Live", "cli")
    assert (tagged.exit_code, tagged.stdout.strip()) == (0, f"run {run_id} (cli live): tags cli, live"), tagged.output
    assert [run.id for run in client.runs(tag="live")] == [run_id]
    listed = loom("runs", "--tag", "live", "--state", "succeeded", COLUMNS="200")
    # Its latest attempt's layout: the restore above moved it to dp_shard 2.
    assert re.search(rf"^\W*{run_id}\W+cli live\W+succeeded\W+dp_shard 2\W+{STEPS}/{STEPS}\b", listed.stdout,
                     re.MULTILINE), listed.stdout  # fmt: skip
    assert loom("run", "archive", str(run_id)).exit_code == 0
    assert run_id not in [run.id for run in client.runs()]
    assert [run.id for run in client.runs(archived=True)] == [run_id]
    assert loom("run", "unarchive", str(run_id)).exit_code == 0
    assert loom("run", "untag", str(run_id), "live", "cli").stdout.strip() == f"run {run_id} (cli live): tags none"
    assert run_id in [run.id for run in client.runs()]
