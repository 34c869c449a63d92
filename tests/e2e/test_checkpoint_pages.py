"""Checkpoints in the browser: the run page's attempts, checkpoints, restore form and resilience
figures, and the lineage page. Most tests fabricate a run's history through the ingest path (no
training); one trains a real run, restores it into another layout from the page and compares losses."""

import json
import re
import time
import urllib.request

import pytest
from django.test import Client
from playwright.sync_api import expect

from loom.checkpoints.services import restore
from loom.runs.forms import NewRunForm
from loom.runs.launcher import claim_attempt
from loom.runs.models import Run
from trainer.config import ParallelConfig

from ..platform.helpers import TINY_CONFIG, BatchSender, checkpoint_event, claimed_run, own_checkpoint
from .test_pages import TINY_FORM

pytestmark = pytest.mark.e2e

TRAINING_TIMEOUT_MS = 240_000
# Tall enough for the whole run page: the page redraws only the charts in view, and these tests follow
# every panel at once (test_charts_out_of_view_wait_to_be_redrawn_until_they_come_into_view scrolls).
VIEWPORT = {"width": 1280, "height": 4000}
LAYOUT = ParallelConfig(dp_replicate=2).model_dump(mode="json")
CHECKPOINTED = {**TINY_CONFIG, "checkpoint": {"interval_steps": 5}}
STEP_TIME_S = 1.0
# An attempt's first three losses drawn, or the attempt over without them (which fails at once).
FIRST_LOSSES_OR_THE_END = """(attempt) => {
  const run = window.loomRun;
  return (run.series.loss[attempt] || []).length >= 3 || ["failed", "cancelled"].includes(run.state);
}"""


# ---- a fabricated history: events as the ranks and the launcher would send them ----


def metric(step, at, rank):
    payload = {
        "loss": 5.0 - step / 10 + rank / 100,
        "loss_mean": 5.0 - step / 10,
        "tokens_per_s": 1000.0 + 10 * rank,
        "step_time_s": STEP_TIME_S,
    }
    return {"kind": "metric", "time": at, "step": step, "payload": payload}


def committed(step, path, at, parent=None):
    return checkpoint_event(
        "committed", step, path, at, bytes=3 * 2**20 + step, layout=LAYOUT, world_size=2, parent=parent,
        stall_s=0.05 * step / 5, save_s=0.5, loss=5.0 - step / 10,
    )  # fmt: skip


def launcher_state(attempt, state, at, **payload):
    return {"kind": "state", "time": at, "payload": {"attempt": attempt.number, "state": state, **payload}}


def train(sender, steps, start):
    for step in steps:
        for rank in (0, 1):
            sender.send(rank, metric(step, start + step * STEP_TIME_S, rank))


@pytest.fixture
def history(platform_user):
    """A run whose first attempt was killed after step 7 and restarted from its step-5 checkpoint;
    the restart trained to step 20, its step-10 checkpoint later found corrupt and its step-15 one
    deleted by retention. Returns (run, {step: checkpoint id}, {attempt number: attempt id})."""
    run, first, _ = claimed_run(platform_user[0], "fabricated history", CHECKPOINTED)
    start = time.time()
    sender = BatchSender(first)
    sender.send(-1, launcher_state(first, "running", start))
    train(sender, range(1, 8), start)
    sender.send(0, committed(5, own_checkpoint(first, 5), start + 5))
    failure = "torchrun exited with code 1\nrank 1 was killed by SIGKILL"
    sender.send(
        -1,
        launcher_state(first, "failed", start + 8, exit_code=1, reason=failure, failure_kind="killed", retryable=True),
    )
    second, _ = claim_attempt(run.attempts.get(number=2).pk)
    sender = BatchSender(second)
    sender.send(-1, launcher_state(second, "running", start + 11))
    train(sender, range(6, 21), start + 6)
    sender.send(0, committed(10, own_checkpoint(second, 10), start + 16, parent=own_checkpoint(first, 5)))
    sender.send(0, committed(15, own_checkpoint(second, 15), start + 21, parent=own_checkpoint(second, 10)))
    sender.send(0, committed(20, own_checkpoint(second, 20), start + 26, parent=own_checkpoint(second, 15)))
    sender.send(0, checkpoint_event("deleted", 15, own_checkpoint(second, 15), start + 27))
    damage = "__1_0.distcp: sha256 mismatch"
    sender.send(0, checkpoint_event("corrupt", 10, own_checkpoint(second, 10), start + 28, error=damage))
    sender.send(-1, launcher_state(second, "succeeded", start + 30, exit_code=0))
    run.refresh_from_db()
    checkpoints = dict(run.checkpoints.values_list("step", "id"))
    attempts = dict(run.attempts.values_list("number", "id"))
    return run, checkpoints, attempts


def open_run(open_logged_in, run_id):
    page = open_logged_in(f"/runs/{run_id}/", VIEWPORT)
    page.wait_for_function("window.loomRun && window.loomRun.detail !== null")
    return page


def checkpoint_rows(page) -> list[tuple[int, str]]:
    rows = page.eval_on_selector_all(
        "#checkpoint-rows tr", "(rows) => rows.map((row) => [Number(row.dataset.step), row.dataset.state])"
    )
    return [tuple(row) for row in rows]


def trace_names(page, chart: str) -> list[str]:
    return page.evaluate(f"document.getElementById('{chart}').data.map((trace) => trace.name)")


def rank_line_steps(page) -> dict[str, list[int]]:
    lines = page.evaluate("document.getElementById('step-time-chart').data.map((line) => [line.name, line.x])")
    return dict(lines)


def api_get(page, path: str):
    return page.evaluate("async (path) => (await fetch(path)).json()", path)


def user_pinned(page, run) -> set[int]:
    return {item["step"] for item in api_get(page, f"/api/runs/{run.pk}/checkpoints") if item["user_pinned"]}


# ---- the run page ----


def test_run_page_shows_attempts_checkpoints_and_resilience_of_a_restarted_run(history, open_logged_in):
    run, checkpoints, _ = history
    page = open_run(open_logged_in, run.pk)

    expect(page.locator("#checkpoint-rows tr")).to_have_count(4)
    assert checkpoint_rows(page) == [(5, "committed"), (10, "corrupt"), (15, "deleted"), (20, "committed")]
    step5 = page.locator('#checkpoint-rows tr[data-step="5"]')
    expect(step5.locator(".checkpoint-attempt")).to_have_text("attempt 1")
    expect(step5.locator(".checkpoint-size")).to_have_text("3.0 MiB")
    expect(step5.locator(".checkpoint-loss")).to_have_text("4.5000")
    expect(step5.locator(".checkpoint-stall")).to_have_text("0.05 s")
    expect(step5.locator(".checkpoint-layout")).to_have_text("dp_replicate 2")
    expect(page.locator('#checkpoint-rows tr[data-step="10"] .checkpoint-parent a')).to_have_attribute(
        "href", f"#checkpoint-{checkpoints[5]}"
    )
    expect(page.locator('#checkpoint-rows tr[data-step="10"] .checkpoint-state')).to_contain_text("sha256 mismatch")
    # Only committed checkpoints can be restored.
    assert page.eval_on_selector_all(
        "#checkpoint-rows tr:has(.restore-button)", "(rows) => rows.map((row) => Number(row.dataset.step))"
    ) == [5, 20]

    first, second = page.locator('tr[data-attempt="1"]'), page.locator('tr[data-attempt="2"]')
    expect(first.locator(".attempt-state")).to_have_text("failed")
    expect(first.locator(".attempt-failure")).to_have_text("killed · retryable")
    expect(first.locator(".attempt-decision")).to_contain_text("restarted as attempt 2 from its checkpoints")
    expect(first.locator(".attempt-reason")).to_contain_text("rank 1 was killed by SIGKILL")
    expect(second.locator(".attempt-trigger")).to_contain_text("restart · from step 5")
    expect(second.locator(".attempt-trigger")).to_contain_text("automatic restart 1 of 3 after attempt 1 failed")
    expect(second.locator(".attempt-trigger a")).to_have_attribute("href", f"#checkpoint-{checkpoints[5]}")
    expect(second.locator(".attempt-state")).to_have_text("succeeded")

    # One trace per attempt; the restart's starts at the step after its checkpoint.
    page.wait_for_function("(document.getElementById('loss-chart').data || []).length === 2")
    assert trace_names(page, "loss-chart") == ["attempt 1", "attempt 2"]
    series = page.evaluate("window.loomRun.series")
    assert [step for step, _ in series["loss"]["1"]] == list(range(1, 8))
    assert [step for step, _ in series["loss"]["2"]] == list(range(6, 21))
    assert series["loss"]["2"][0][1] == pytest.approx(5.0 - 6 / 10)
    # Rank 0's batch's tokens/s (1000; rank 1 reports 1010) times the attempt's 2 data-parallel ranks.
    assert {value for _, value in series["tokens_per_s"]["2"]} == {2000.0}
    assert trace_names(page, "tokens-chart") == ["attempt 1", "attempt 2"]
    # The per-rank panels show the latest attempt, or the one picked.
    page.wait_for_function("window.loomRun.panels.ranks.step_time_s?.attempt === 2")
    assert rank_line_steps(page) == {"rank 0": list(range(6, 21)), "rank 1": list(range(6, 21))}
    page.select_option("#panel-attempt", "1")
    page.wait_for_function("window.loomRun.panels.ranks.step_time_s.attempt === 1")
    assert rank_line_steps(page) == {"rank 0": list(range(1, 8)), "rank 1": list(range(1, 8))}
    page.wait_for_function("window.loomRun.panels.heatmap.attempt === 1")

    expect(page.locator("#resilience-restarts")).to_have_text("1")
    expect(page.locator("#resilience-failed")).to_have_text("1")
    expect(page.locator("#resilience-ettr")).to_have_text(re.compile(r"^\d+\.\d %$"))
    expect(page.locator("#resilience-stall")).to_have_text(re.compile(r"^mean 0\.\d\d s · max 0\.20 s \(4 saves\)$"))
    failure = page.locator('#failure-rows tr[data-failed-attempt="1"] td')
    expect(failure).to_have_text(["attempt 1", "killed", "7", "5", "2", re.compile(r"^\d+\.\d$")])
    expect(page.locator("#resilience-advice")).to_have_text(
        re.compile(
            r"^saving every 5 steps ≈ 5\.0 s; Young/Daly √\(2·MTBF·C\) with MTBF \d+ s, C 0\.\d\d s "
            r"suggests every \d+ steps? \(\d+\.\d s\)$"
        )
    )
    expect(page.locator("#lineage-link")).to_have_attribute("href", f"/runs/{run.pk}/lineage/")


@pytest.fixture
def running(platform_user, platform_server):
    """A run whose first attempt is running and has reported three steps; the test sends the rest
    through the ingest API while the page is open. Returns (run, attempt, token, ingest url)."""
    run, attempt, token = claimed_run(platform_user[0], "running", CHECKPOINTED)
    sender = BatchSender(attempt)
    start = time.time()
    sender.send(-1, launcher_state(attempt, "running", start))
    train(sender, range(1, 4), start)
    return run, attempt, token, f"{platform_server.url}/api/ingest"


def post_batch(url, token, attempt, rank, seq, events):
    body = json.dumps({"attempt": attempt.pk, "rank": rank, "seq": seq, "events": events}).encode()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=30) as response:
        assert response.status == 200


def test_checkpoints_and_a_restart_appear_live_and_a_running_run_only_forks(running, open_logged_in):
    run, attempt, token, ingest_url = running
    page = open_run(open_logged_in, run.pk)
    expect(page.locator("#checkpoints-empty")).to_be_visible()
    expect(page.locator("#run-state")).to_have_text("running")

    now = time.time()
    post_batch(ingest_url, token, attempt, 0, 10, [committed(5, own_checkpoint(attempt, 5), now)])
    expect(page.locator("#checkpoint-rows tr")).to_have_count(1)
    assert checkpoint_rows(page) == [(5, "committed")]

    # While the run is running, a restore can only fork.
    page.click('#checkpoint-rows tr[data-step="5"] .restore-button')
    expect(page.locator("#restore-form")).to_be_visible()
    expect(page.locator('input[name="restore-mode"][value="fork"]')).to_be_checked()
    expect(page.locator("#restore-launch")).to_be_enabled()
    page.check('input[name="restore-mode"][value="attempt"]')
    expect(page.locator("#restore-launch")).to_be_disabled()
    expect(page.locator("#restore-launch")).to_have_attribute("title", re.compile("a fork can start now"))
    expect(page.locator("#restore-busy")).to_contain_text("Attempt 1 is running")
    page.click("#restore-close")
    expect(page.locator("#restore-form")).to_be_hidden()

    failure = {"exit_code": 1, "reason": "torchrun exited with code 1\nrank 0 lost its peer"}
    failed = launcher_state(attempt, "failed", now + 1, **failure, failure_kind="lost_peer", retryable=True)
    post_batch(ingest_url, token, attempt, -1, 10, [failed])
    # The automatic restart appears without a reload, and the run follows it.
    expect(page.locator('tr[data-attempt="2"] .attempt-trigger')).to_contain_text("restart · from step 5")
    expect(page.locator('tr[data-attempt="2"] .attempt-state')).to_have_text("queued")
    expect(page.locator('tr[data-attempt="1"] .attempt-failure')).to_have_text("lost_peer · retryable")
    expect(page.locator("#run-state")).to_have_text("queued")
    expect(page.locator("#resilience-failed")).to_have_text("1")
    assert page.evaluate("[...document.querySelectorAll('#log-rank option')].map((option) => option.value)") == [
        "0",
        "1",
    ]


def open_restore(page, step):
    page.click(f'#checkpoint-rows tr[data-step="{step}"] .restore-button')
    expect(page.locator("#restore-form")).to_be_visible()


def test_the_checkpoint_table_shows_why_each_is_pinned_and_pins_and_unpins(history, open_logged_in):
    run, _, _ = history
    # The killed attempt's rank-exit alert (after step 7) pins the checkpoint triage offers: step 5.
    page = open_run(open_logged_in, run.pk)
    (exit_alert,) = [alert for alert in api_get(page, f"/api/runs/{run.pk}/alerts") if alert["rule"] == "rank_exit"]
    before_exit, newest = page.locator('tr[data-step="5"]'), page.locator('tr[data-step="20"]')
    pinned_by_alert = f"kept past retention: pinned by alert #{exit_alert['id']} (rank exit at step 7)"
    expect(before_exit.locator(".checkpoint-pins")).to_have_text(pinned_by_alert)
    expect(before_exit.locator(".badge.state-pinned")).to_have_text("pinned")
    expect(newest.locator(".checkpoint-pins")).to_have_count(0)

    newest.locator(".pin-button").click()
    expect(newest.locator(".checkpoint-pins")).to_have_text("kept past retention: pinned by ada")
    expect(newest.locator(".pin-button")).to_have_text("Unpin")
    assert user_pinned(page, run) == {20}
    newest.locator(".pin-button").click()
    expect(newest.locator(".checkpoint-pins")).to_have_count(0)
    expect(newest.locator(".pin-button")).to_have_text("Pin")
    assert user_pinned(page, run) == set()
    # Unpinning is a person's: the alert's pin stays until the alert is resolved.
    before_exit.locator(".pin-button").click()
    expect(before_exit.locator(".pin-button")).to_have_text("Unpin")
    before_exit.locator(".pin-button").click()
    expect(before_exit.locator(".pin-button")).to_have_text("Pin")
    expect(before_exit.locator(".checkpoint-pins")).to_have_text(pinned_by_alert)
    # A corrupt or deleted checkpoint can be neither restored nor pinned.
    expect(page.locator('tr[data-step="10"] .pin-button')).to_have_count(0)
    expect(page.locator('tr[data-step="15"] .pin-button')).to_have_count(0)


def test_restore_form_puts_layout_errors_beside_their_inputs_then_starts_a_new_attempt(history, open_logged_in):
    run, checkpoints, _ = history
    page = open_run(open_logged_in, run.pk)
    runs_before = len(api_get(page, "/api/runs")["runs"])
    open_restore(page, 20)
    expect(page.locator("#restore-title")).to_have_text("Restore step 20 (attempt 2, dp_replicate 2)")
    expect(page.locator('input[name="restore-mode"][value="attempt"]')).to_be_checked()
    # Prefilled from the checkpoint's layout.
    expect(page.locator("#restore-parallel-dp_replicate")).to_have_value("2")
    expect(page.locator("#restore-parallel-tp")).to_have_value("1")
    expect(page.locator("#restore-parallel-pp_schedule")).to_have_value("1F1B")
    expect(page.locator("#restore-world-size")).to_have_text("(2 ranks, saved on 2)")

    page.fill("#restore-parallel-tp", "3")
    expect(page.locator("#restore-world-size")).to_have_text("(6 ranks, saved on 2)")
    page.click("#restore-launch")
    tp_error = page.locator('#restore-form .field-error[data-for="config.parallel.tp"]')
    expect(tp_error).to_contain_text("heads")
    # The sequence length has no input here: its error goes to the top of the form.
    expect(page.locator("#restore-errors")).to_contain_text("config.model.seq_len:")
    expect(page.locator(".input:has(#restore-parallel-tp)")).to_have_class(re.compile("has-error"))
    assert len(api_get(page, "/api/runs")["runs"]) == runs_before
    assert len(api_get(page, f"/api/runs/{run.pk}")["attempts"]) == 2

    page.fill("#restore-parallel-tp", "1")
    page.fill("#restore-parallel-dp_replicate", "1")
    page.fill("#restore-parallel-dp_shard", "2")
    page.fill("#restore-steps", "30")
    page.click("#restore-launch")
    expect(page.locator("#restore-form")).to_be_hidden()
    third = page.locator('tr[data-attempt="3"]')
    expect(third.locator(".attempt-trigger")).to_contain_text("restore · from step 20")
    expect(third.locator(".attempt-state")).to_have_text("queued")
    expect(page.locator("#run-state")).to_have_text("queued")
    attempt = api_get(page, f"/api/runs/{run.pk}")["attempts"][2]
    assert (attempt["parallel"]["dp_replicate"], attempt["parallel"]["dp_shard"], attempt["restored_from"]) == (
        1,
        2,
        checkpoints[20],
    )
    assert len(api_get(page, "/api/runs")["runs"]) == runs_before


def test_a_fork_from_the_form_opens_the_new_run_which_links_back(history, open_logged_in):
    run, checkpoints, _ = history
    page = open_run(open_logged_in, run.pk)
    open_restore(page, 5)
    page.check('input[name="restore-mode"][value="fork"]')
    expect(page.locator("#restore-name")).to_have_attribute("placeholder", "fabricated history from step 5")
    page.fill("#restore-name", "tiny fork")
    page.click("#restore-launch")
    page.wait_for_url(re.compile(rf"/runs/(?!{run.pk}/)\d+/$"))
    expect(page.locator("h1")).to_contain_text("tiny fork")
    forked_from = page.locator("#forked-from a")
    expect(forked_from).to_have_text(f"run {run.pk} at step 5")
    expect(forked_from).to_have_attribute("href", f"/runs/{run.pk}/#checkpoint-{checkpoints[5]}")
    trigger = page.locator('tr[data-attempt="1"] .attempt-trigger')
    expect(trigger).to_contain_text("restore · from step 5")
    expect(trigger).to_contain_text(f"forked from run {run.pk} at step 5")

    forked_from.click()
    page.wait_for_url(f"**/runs/{run.pk}/#checkpoint-{checkpoints[5]}")
    expect(page.locator("tr.targeted")).to_have_attribute("data-step", "5")


# ---- the lineage page ----


@pytest.fixture
def family(history, platform_user):
    """The fabricated history and a run forked from its step-5 checkpoint (its launch stays queued)."""
    run, checkpoints, attempts = history
    fork = restore(platform_user[0], run, checkpoints[5], "fork", name="fork of the history").run
    return run, fork, checkpoints, attempts, fork.attempts.get().pk


def lineage_elements(page, selector: str, *attributes: str) -> list[tuple]:
    return [
        tuple(row)
        for row in page.eval_on_selector_all(
            selector,
            "(nodes, attributes) => nodes.map((node) => attributes.map((name) => node.getAttribute(name)))",
            list(attributes),
        )
    ]


def test_lineage_page_draws_runs_attempts_checkpoints_and_the_fork(family, open_logged_in):
    run, fork, checkpoints, attempts, fork_attempt = family
    page = open_logged_in(f"/runs/{fork.pk}/lineage/", VIEWPORT)
    page.wait_for_function("window.loomLineage && window.loomLineage.ready")
    expect(page.locator("#lineage-status")).to_have_text("2 runs, 3 attempts, 4 checkpoints")

    assert lineage_elements(page, "g.lineage-lane", "data-run", "data-current") == [
        (str(run.pk), "false"),
        (str(fork.pk), "true"),
    ]
    assert lineage_elements(page, "g.lineage-attempt", "data-run", "data-number", "data-state", "data-trigger") == [
        (str(run.pk), "1", "failed", "created"),
        (str(run.pk), "2", "succeeded", "restart"),
        (str(fork.pk), "1", "queued", "restore"),
    ]
    expect(page.locator(f'g.lineage-attempt[data-attempt-id="{attempts[1]}"] text')).to_have_text(
        "attempt 1 · failed · created"
    )
    assert lineage_elements(page, "g.lineage-checkpoint", "data-step", "data-state") == [
        ("5", "committed"),
        ("10", "corrupt"),
        ("15", "deleted"),
        ("20", "committed"),
    ]
    edges = set(lineage_elements(page, "path.lineage-edge", "data-edge", "data-from", "data-to"))
    assert edges == {
        ("parent", f"checkpoint-{checkpoints[5]}", f"checkpoint-{checkpoints[10]}"),
        ("parent", f"checkpoint-{checkpoints[10]}", f"checkpoint-{checkpoints[15]}"),
        ("parent", f"checkpoint-{checkpoints[15]}", f"checkpoint-{checkpoints[20]}"),
        ("restart", f"checkpoint-{checkpoints[5]}", f"attempt-{attempts[2]}"),
        ("fork", f"checkpoint-{checkpoints[5]}", f"attempt-{fork_attempt}"),
    }
    corrupt = page.locator(f'g.lineage-checkpoint[data-checkpoint="{checkpoints[10]}"] > title')
    expect(corrupt).to_contain_text(f"/run-{run.pk}/attempt-2/checkpoints/step-000010")
    expect(corrupt).to_contain_text("problem: __1_0.distcp: sha256 mismatch")
    expect(corrupt).to_contain_text("size 3.0 MiB · loss 4.0000 · training stalled 0.10 s")
    failed = page.locator(f'g.lineage-attempt[data-attempt-id="{attempts[1]}"] > title')
    expect(failed).to_contain_text("failure (killed): torchrun exited with code 1 / rank 1 was killed by SIGKILL")
    expect(failed).to_contain_text("restart decision: restarted as attempt 2")

    page.click(f'g.lineage-checkpoint[data-checkpoint="{checkpoints[20]}"] circle')
    page.wait_for_url(f"**/runs/{run.pk}/#checkpoint-{checkpoints[20]}")
    expect(page.locator("tr.targeted")).to_have_attribute("data-step", "20")
    page.go_back()
    page.wait_for_function("window.loomLineage && window.loomLineage.ready")
    page.click(f'g.lineage-attempt[data-attempt-id="{attempts[2]}"] rect')
    page.wait_for_url(f"**/runs/{run.pk}/#attempt-2")
    expect(page.locator("tr.targeted")).to_have_attribute("data-attempt", "2")


@pytest.mark.django_db
def test_lineage_page_is_the_owners_only(platform_user, other_user):
    run = Run.objects.create(owner=platform_user[0], name="mine", config=TINY_CONFIG)
    path = f"/runs/{run.pk}/lineage/"
    anonymous = Client().get(path)
    assert (anonymous.status_code, anonymous["Location"]) == (302, f"/login/?next={path}")
    stranger = Client()
    stranger.force_login(other_user)
    assert stranger.get(path).status_code == 404
    owner = Client()
    owner.force_login(platform_user[0])
    response = owner.get(path)
    assert response.status_code == 200
    assert response.context["page"] == {"run": run.pk, "apiUrl": f"/api/runs/{run.pk}/lineage"}
    assert "/static/lineage.js" in response.content.decode()


@pytest.mark.django_db
def test_new_run_form_asks_for_checkpoints_and_restarts(platform_user):
    client = Client()
    client.force_login(platform_user[0])
    page = client.get("/runs/new/").content.decode()
    assert "<legend>Checkpoints</legend>" in page
    assert 'name="checkpoint.interval_steps" value="0"' in page and "Save every N steps" in page
    assert 'name="restart.max_restarts" value="3"' in page
    form = {**TINY_FORM, "checkpoint.interval_steps": "5", "checkpoint.keep_last": "2", "restart.max_restarts": "0"}
    assert set(NewRunForm().fields) >= {"checkpoint.interval_steps", "checkpoint.keep_last", "restart.max_restarts"}
    assert client.post("/runs/new/", form).status_code == 302
    config = Run.objects.get().config
    assert (config["checkpoint"]["interval_steps"], config["checkpoint"]["keep_last"]) == (5, 2)
    assert config["restart"]["max_restarts"] == 0
    refused = client.post("/runs/new/", {**form, "checkpoint.keep_last": "0"})
    assert "greater than or equal to 1" in " ".join(refused.context["form"].errors["checkpoint.keep_last"])


# ---- a real run, restored from the page into another layout ----


@pytest.mark.slow
def test_a_checkpoint_restored_from_the_page_into_fsdp_continues_with_the_same_losses(live_platform, open_logged_in):
    """DDP over 2 ranks trains 20 steps, saving every 5; step 10 is restored as attempt 2 with FSDP
    over the same 2 data-parallel ranks (the data order depends on the data-parallel degree, so it
    stays 2). Resharding is exact in fp32: attempt 2's losses are attempt 1's at the same steps."""
    page = open_logged_in("/", VIEWPORT)
    config = {**CHECKPOINTED, "steps": 20, "parallel": {"dp_replicate": 2}}
    created = page.evaluate(
        """async (config) => {
          const response = await loom.post("/api/runs", { name: "ddp then fsdp", config });
          return response.json();
        }""",
        config,
    )
    page.goto(f"/runs/{created['id']}/")
    expect(page.locator("#run-state")).to_have_text("succeeded", timeout=TRAINING_TIMEOUT_MS)
    expect(page.locator('#checkpoint-rows tr[data-step="5"]')).to_have_attribute("data-state", "deleted")
    # keep_last 3: step 5 went when step 20 was committed.
    assert checkpoint_rows(page) == [(5, "deleted"), (10, "committed"), (15, "committed"), (20, "committed")]
    expect(page.locator('#checkpoint-rows tr[data-step="10"] .checkpoint-layout')).to_have_text("dp_replicate 2")
    first = dict(page.evaluate("window.loomRun.series.loss[1]"))
    assert sorted(first) == list(range(1, 21))

    open_restore(page, 10)
    page.fill("#restore-parallel-dp_replicate", "1")
    page.fill("#restore-parallel-dp_shard", "2")
    expect(page.locator("#restore-world-size")).to_have_text("(2 ranks, saved on 2)")
    page.click("#restore-launch")
    expect(page.locator("#restore-form")).to_be_hidden()
    expect(page.locator('tr[data-attempt="2"] .attempt-trigger')).to_contain_text("restore · from step 10")

    # The new attempt's first losses arrive live as its own trace, continuing from step 11.
    page.wait_for_function(FIRST_LOSSES_OR_THE_END, arg=2, polling="raf", timeout=TRAINING_TIMEOUT_MS)
    first_steps = page.evaluate("(window.loomRun.series.loss[2] || []).slice(0, 3).map(([step]) => step)")
    assert first_steps == [11, 12, 13], page.locator('tr[data-attempt="2"]').inner_text()
    assert trace_names(page, "loss-chart") == ["attempt 1", "attempt 2"]
    expect(page.locator("#run-state")).to_have_text("succeeded", timeout=TRAINING_TIMEOUT_MS)
    drawn = page.evaluate(
        "(() => { const trace = document.getElementById('loss-chart').data[1]; return [trace.x, trace.y]; })()"
    )
    second = dict(zip(*drawn, strict=True))
    assert sorted(second) == list(range(11, 21))
    for step, loss in second.items():
        assert loss == pytest.approx(first[step], rel=1e-4), f"step {step}"
    layout = page.locator('#checkpoint-rows tr[data-step="20"][data-attempt="2"] .checkpoint-layout')
    expect(layout).to_have_text("dp_shard 2")

    page.goto(f"/runs/{created['id']}/lineage/")
    page.wait_for_function("window.loomLineage && window.loomLineage.ready")
    restored_step = page.evaluate(
        """() => {
          const edge = document.querySelector('path.lineage-edge[data-edge="restore"]');
          const from = edge.dataset.from.replace("checkpoint-", "");
          return Number(document.querySelector(`g.lineage-checkpoint[data-checkpoint="${from}"]`).dataset.step);
        }"""
    )
    assert restored_step == 10
