"""Checkpoints: atomic commit with a manifest, verification on load, retention, exact resume, resume
into other layouts, and the save a SIGTERM triggers.

The torchrun tests share launches: one straight FSDP 2 run saves every step, and the others resume
from (copies of) its checkpoints."""

import base64
import hashlib
import json
import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import (
    MANIFEST,
    CheckpointCorrupt,
    CheckpointError,
    checkpoint_root,
    commit,
    committed_checkpoints,
    full_name,
    holds_checkpoints,
    latest_good,
    pinned_among,
    restore_rng_states,
    rng_states,
    steps_to_delete,
    verify,
    without_stage_number,
    written_by,
)
from trainer.config import ConfigError, parse_config
from trainer.telemetry import Pins, TelemetryClient

from .torchrun import FinishedRun, kill_trainer, run_trainer, start_trainer, started_run_result, wait_for_output

STEPS = 6
HALF = 3
GLOBAL_BATCH = 8
RUN_ID = "run-42"
ATTEMPT = "7"
TOLERANCES = {"loss_relative": 1e-5, "parameter_max": 1e-4, "parameter_norm_relative": 1e-4}


def document(checkpoint: dict, micro_batch_divisor: int = 1, steps: int = STEPS, **parallel) -> dict:
    """The equivalence test's tiny fp32 run: the global batch is GLOBAL_BATCH in every layout."""
    return {
        "steps": steps,
        "model": {"layers": 4, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq_len": 32},
        "parallel": parallel,
        "compute": {"precision": "fp32"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "data": {"micro_batch": GLOBAL_BATCH // micro_batch_divisor, "corpus_bytes": 200_000},
        "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 60, "comm": False},
        "checkpoint": checkpoint,
    }


def fsdp2(checkpoint: dict, **overrides) -> dict:
    return document(checkpoint, 2, dp_shard=2, **overrides)


def checkpoint_events(run: FinishedRun, state: str) -> list[dict]:
    return [event["payload"] for _, event in run.events("checkpoint") if event["payload"]["state"] == state]


def metric_steps(run: FinishedRun) -> list[int]:
    return sorted(event["step"] for rank, event in run.events("metric") if rank == 0)


def assert_same_math(resumed: FinishedRun, straight: FinishedRun, resumed_after: int = HALF) -> None:
    """Another layout sums in another order: the equivalence test's tolerances, over the steps after `resumed_after`."""
    for step, (want, got) in enumerate(
        zip(straight.loss_means()[resumed_after:], resumed.loss_means(), strict=True), start=resumed_after + 1
    ):
        assert abs(got - want) <= TOLERANCES["loss_relative"] * abs(want), f"step {step}: {got} vs {want}"
    reference, parameters = straight.parameters(), resumed.parameters()
    assert sorted(parameters) == sorted(reference)
    for name, tensor in reference.items():
        difference = parameters[name] - tensor
        assert difference.abs().max() <= TOLERANCES["parameter_max"], name
        assert difference.norm() <= TOLERANCES["parameter_norm_relative"] * tensor.norm(), name


# Files, manifests, retention and the choice of checkpoint: no process group needed.


def write_checkpoint_files(directory: Path, contents: dict[str, bytes]) -> Path:
    directory.mkdir(parents=True)
    for name, data in contents.items():
        (directory / name).write_bytes(data)
    return directory


def committed_at(root: Path, step: int, payload: bytes = b"weights") -> Path:
    files = {".metadata": b"meta", "__0_0.distcp": payload}
    temporary = write_checkpoint_files(root / f"step-{step:06d}.tmp-test", files)
    final = root / f"step-{step:06d}"
    commit(temporary, final, {"step": step})
    return final


def test_commit_writes_a_manifest_of_every_file_then_renames(tmp_path):
    files = {".metadata": b"meta", "__0_0.distcp": b"abc"}
    temporary = write_checkpoint_files(tmp_path / "step-000010.tmp-a1-x", files)
    manifest = commit(temporary, tmp_path / "step-000010", {"step": 10, "loss": 2.5})

    assert not temporary.exists()
    assert json.loads((tmp_path / "step-000010" / MANIFEST).read_text()) == manifest
    assert manifest["step"] == 10 and manifest["loss"] == 2.5
    assert manifest["files"] == [
        {"path": ".metadata", "bytes": 4, "sha256": hashlib.sha256(b"meta").hexdigest()},
        {"path": "__0_0.distcp", "bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()},
    ]
    assert manifest["bytes"] == 7
    assert verify(tmp_path / "step-000010") == manifest


def test_commit_replaces_a_committed_checkpoint_of_the_same_step(tmp_path):
    committed_at(tmp_path, 10, b"old")
    committed_at(tmp_path, 10, b"new")
    assert [path.name for path in tmp_path.iterdir()] == ["step-000010"]
    assert (tmp_path / "step-000010" / "__0_0.distcp").read_bytes() == b"new"


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda path: path.write_bytes(b"wxights"), "sha256 mismatch"),
        (lambda path: path.write_bytes(b"weigh"), "size 5 bytes, the manifest says 7"),
        (lambda path: path.unlink(), "missing"),
    ],
)
def test_verify_names_the_damaged_file(tmp_path, damage, problem):
    checkpoint = committed_at(tmp_path, 10)
    damage(checkpoint / "__0_0.distcp")
    with pytest.raises(CheckpointCorrupt) as error:
        verify(checkpoint)
    assert str(error.value) == f"step-000010/__0_0.distcp: {problem}"


def test_verify_refuses_a_directory_without_a_manifest_and_a_missing_one(tmp_path):
    write_checkpoint_files(tmp_path / "step-000010", {"__0_0.distcp": b"x"})
    with pytest.raises(CheckpointCorrupt, match=r"step-000010/manifest.json: missing"):
        verify(tmp_path / "step-000010")
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        verify(tmp_path / "step-000020")


def test_only_final_names_with_a_manifest_count_as_committed(tmp_path):
    for step in (20, 3, 10):
        committed_at(tmp_path, step)
    temporary = committed_at(tmp_path, 30)
    temporary.rename(tmp_path / "step-000030.tmp-a1-abandoned")
    write_checkpoint_files(tmp_path / "step-000040", {"__0_0.distcp": b"no manifest"})
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [path.name for path in committed_checkpoints(tmp_path)] == ["step-000003", "step-000010", "step-000020"]
    assert committed_checkpoints(tmp_path / "absent") == []


def test_resume_searches_a_directory_that_is_not_itself_a_checkpoint(tmp_path):
    committed_at(tmp_path / "attempt-7", 10)
    (tmp_path / "empty").mkdir()
    write_checkpoint_files(tmp_path / "step-000020", {"__0_0.distcp": b"never committed"})
    assert holds_checkpoints(tmp_path / "attempt-7")
    assert holds_checkpoints(tmp_path / "empty"), "searched, so the error says that it holds none"
    assert not holds_checkpoints(tmp_path / "attempt-7" / "step-000010")
    assert not holds_checkpoints(tmp_path / "step-000020"), "a checkpoint's name: verify says it was never committed"
    assert not holds_checkpoints(tmp_path / "absent")


def test_latest_good_falls_back_past_corrupt_checkpoints_and_reports_them(tmp_path):
    for step in (1, 2, 3):
        committed_at(tmp_path, step)
    (tmp_path / "step-000003" / "__0_0.distcp").write_bytes(b"garbage")
    reported = []
    path, manifest = latest_good(tmp_path, verify, lambda path, error: reported.append((path.name, str(error))))
    assert path.name == "step-000002" and manifest["step"] == 2
    assert reported == [("step-000003", "step-000003/__0_0.distcp: sha256 mismatch")]


def test_latest_good_is_none_when_nothing_checks_out(tmp_path):
    committed_at(tmp_path, 1)
    (tmp_path / "step-000001" / "__0_0.distcp").unlink()
    assert latest_good(tmp_path, verify, lambda path, error: None) is None
    assert latest_good(tmp_path / "empty", verify, lambda path, error: None) is None


@pytest.mark.parametrize(
    ("steps", "committed_step", "keep_last", "keep_every", "deleted"),
    [
        ([1, 2, 3, 4, 5, 6], 6, 2, 3, [1, 2, 4]),
        ([1, 2, 3, 4, 5, 6], 6, 2, 0, [1, 2, 3, 4]),
        ([10, 20, 30], 30, 5, 0, []),
        ([6, 1, 5, 2], 6, 1, 2, [1, 5]),
        ([7], 7, 3, 0, []),
        # Resumed from step 3 and committed step 4: 5 and 6 are a branch left behind, even milestones.
        ([1, 2, 3, 4, 5, 6], 4, 2, 3, [1, 2, 5, 6]),
    ],
)
def test_retention_keeps_the_newest_and_the_milestones(steps, committed_step, keep_last, keep_every, deleted):
    assert steps_to_delete(steps, committed_step, keep_last, keep_every) == deleted


@pytest.mark.parametrize(
    ("steps", "committed_step", "pinned", "deleted"),
    [
        # keep_last 2: 60 pinned (the checkpoint before an alert's step) stays beside the newest two.
        ([40, 50, 60, 70, 80, 90], 90, {60}, [40, 50, 70]),
        ([40, 50, 60, 70, 80, 90], 90, {40, 80}, [50, 60, 70]),
        # A pin on a step retention keeps anyway changes nothing.
        ([40, 50, 60], 60, {60}, [40]),
        # Resumed from 30 and committed 40: 50 and 60 are a branch left behind, pinned or not.
        ([10, 20, 30, 40, 50, 60], 40, {20, 50}, [10, 50, 60]),
    ],
)
def test_retention_keeps_pinned_steps_of_the_lineage(steps, committed_step, pinned, deleted):
    assert steps_to_delete(steps, committed_step, 2, 0, frozenset(pinned)) == deleted


def test_retention_keeps_what_the_platform_pinned_and_everything_when_it_cannot_say(tmp_path):
    candidates = {step: tmp_path / f"step-{step:06d}" for step in (40, 50)}
    pinned = {str(candidates[50]): ["pinned by alert #12 (loss spike at step 70)", "pinned by ada"]}
    both = "pinned by alert #12 (loss spike at step 70); pinned by ada"
    assert pinned_among(candidates, lambda: Pins(pinned), [40, 50, 60]) == {50: both}
    assert pinned_among({}, lambda: Pins(pinned), [60]) == {}
    # The alerts have judged to step 55: one at 56-60 would restore from 50, so 50 stays too; 40 may go.
    assert pinned_among(candidates, lambda: Pins({}, judged_through=55), [40, 50, 60]) == {
        50: "the platform's alerts have judged steps only to 55; one at steps 51–60 would restore from it"
    }
    assert pinned_among(candidates, lambda: Pins({}, judged_through=60), [40, 50, 60]) == {}
    # Nothing listens on the port any more: the platform cannot be asked, so nothing may go.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    client = TelemetryClient(url, "token", 7, 0, tmp_path / "spool", flush_interval_s=1.0, heartbeat_interval_s=None)
    try:
        kept = pinned_among(candidates, client.pinned_checkpoints, [40, 50, 60])
    finally:
        client.close(0.0)
    assert set(kept) == {40, 50}
    assert all(why.startswith("the platform could not say whether it is pinned (") for why in kept.values())
    assert url in kept[40] and "Connection refused" in kept[40]
    offline = TelemetryClient(None, None, None, 0, tmp_path / "offline", 1.0, None)
    assert pinned_among(candidates, offline.pinned_checkpoints, [40, 50, 60]) == {}
    offline.close(0.0)


def test_only_checkpoints_of_the_same_run_and_attempt_count_as_written_by_it(tmp_path):
    root = tmp_path / "checkpoints"
    own = committed_at(root, 5)
    manifest = json.loads((own / MANIFEST).read_text())
    (own / MANIFEST).write_text(json.dumps({**manifest, "run_id": RUN_ID, "attempt": 7}))
    assert written_by(own, RUN_ID, 7)
    assert not written_by(own, RUN_ID, 8) and not written_by(own, "run-43", 7) and not written_by(own, None, None)
    # A link named like a checkpoint leads out of the directory: never this attempt's own.
    (root / "step-000006").symlink_to(own)
    assert not written_by(root / "step-000006", RUN_ID, 7)
    # Offline (no platform) a run is the same as the last one run by hand in its directory.
    assert written_by(committed_at(root, 10), None, None)


@pytest.mark.parametrize(
    ("key", "full_name"),
    [
        ("0.blocks.3.attention.wq.weight", "blocks.3.attention.wq.weight"),
        ("1.output.weight", "output.weight"),
        ("state.0.blocks.3.mlp.w1.weight.exp_avg", "state.blocks.3.mlp.w1.weight.exp_avg"),
        ("param_groups.1.norm.weight.lr", "param_groups.norm.weight.lr"),
    ],
)
def test_state_keys_lose_the_number_of_the_stage_holding_them(key, full_name):
    assert without_stage_number(key) == full_name


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("0.output.weight", "embedding.weight"),
        ("1.output.weight", "embedding.weight"),
        ("state.1.output.weight.exp_avg", "state.embedding.weight.exp_avg"),
        ("param_groups.0.output.weight.lr", "param_groups.embedding.weight.lr"),
        ("0.embedding.weight", "embedding.weight"),
        ("0.blocks.3.attention.wo.weight", "blocks.3.attention.wo.weight"),
    ],
)
def test_a_tied_models_output_matrix_is_saved_under_the_embeddings_name(key, name):
    assert full_name(key, tied=True) == name
    assert full_name("1.output.weight", tied=False) == "output.weight"


def test_rng_states_survive_json_and_replay_the_same_numbers():
    cpu = torch.device("cpu")
    saved = json.loads(json.dumps(rng_states(cpu)))
    expected = torch.rand(4)
    torch.rand(100)
    restore_rng_states(saved, cpu)
    assert torch.equal(torch.rand(4), expected)


def test_checkpoint_root_prefers_the_config_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert checkpoint_root("/data/ckpt", "/env/ckpt") == Path("/data/ckpt")
    assert checkpoint_root(None, "/env/ckpt") == Path("/env/ckpt")
    assert checkpoint_root(None, None) == tmp_path / "checkpoints"


def test_checkpoint_config_fields_and_errors():
    section = parse_config({}).checkpoint
    assert (section.interval_steps, section.interval_minutes, section.keep_last, section.keep_every) == (0, 0, 3, 0)
    assert (section.directory, section.resume, section.async_save) == (None, None, True)
    assert not section.saves
    assert parse_config({"checkpoint": {"interval_minutes": 0.5}}).checkpoint.saves
    with pytest.raises(ConfigError) as error:
        parse_config({"checkpoint": {"keep_last": 0, "interval_steps": -1, "resume": ""}})
    assert set(error.value.errors) == {"checkpoint.keep_last", "checkpoint.interval_steps", "checkpoint.resume"}


# Whole runs under torchrun.


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[FinishedRun, Path]:
    """FSDP 2, STEPS steps, a checkpoint after every one; the newest 2 and every 3rd are kept."""
    workdir = tmp_path_factory.mktemp("straight")
    directory = workdir / "checkpoints"
    checkpoint = {"interval_steps": 1, "keep_last": 2, "keep_every": 3, "directory": str(directory)}
    run = run_trainer(workdir, fsdp2(checkpoint), extra_env={"LOOM_RUN_ID": RUN_ID, "LOOM_ATTEMPT": ATTEMPT})
    assert run.returncode == 0, run.output[-4000:]
    return run, directory


@pytest.fixture(scope="module")
def corrupted(straight, tmp_path_factory) -> Path:
    """A copy of the straight run's checkpoints with the newest damaged, next to decoys that look
    newer but are not committed: a temporary directory with a manifest, and one without a manifest."""
    _, directory = straight
    copy = tmp_path_factory.mktemp("corrupted") / "checkpoints"
    shutil.copytree(directory, copy)
    shard = copy / "step-000006" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    shutil.copytree(copy / "step-000005", copy / "step-000009.tmp-a3-deadbeef")
    shutil.copytree(copy / "step-000005", copy / "step-000008")
    (copy / "step-000008" / MANIFEST).unlink()
    return copy


@pytest.mark.slow
def test_retention_keeps_the_newest_two_and_every_third_and_reports_deletions(straight):
    run, directory = straight
    assert sorted(path.name for path in directory.iterdir()) == ["step-000003", "step-000005", "step-000006"]
    deleted = checkpoint_events(run, "deleted")
    assert [(event["step"], event["path"]) for event in deleted] == [
        (step, str(directory / f"step-{step:06d}")) for step in (1, 2, 4)
    ]
    assert all(f"deleted checkpoint {directory / f'step-{step:06d}'}" in run.output for step in (1, 2, 4))


@pytest.mark.slow
def test_every_commit_is_reported_once_by_rank_zero(straight):
    run, directory = straight
    committed = [(rank, event["payload"]) for rank, event in run.events("checkpoint")]
    committed = [(rank, payload) for rank, payload in committed if payload["state"] == "committed"]
    assert [payload["step"] for _, payload in committed] == list(range(1, STEPS + 1))
    assert {rank for rank, _ in committed} == {0}
    parent = None
    for (_, payload), loss_mean in zip(committed, run.loss_means(), strict=True):
        path = directory / f"step-{payload['step']:06d}"
        assert payload["path"] == str(path) and payload["parent"] == parent
        assert payload["world_size"] == 2 and payload["layout"]["dp_shard"] == 2
        assert payload["loss"] == loss_mean
        assert payload["bytes"] > 0
        assert 0 < payload["stall_s"] <= payload["save_s"]
        parent = str(path)


@pytest.mark.slow
def test_committed_manifests_hold_the_sizes_and_checksums_of_the_files(straight):
    run, directory = straight
    losses = run.loss_means()
    for path in sorted(directory.iterdir()):
        manifest = json.loads((path / MANIFEST).read_text())
        files = sorted(file.name for file in path.iterdir() if file.name != MANIFEST)
        assert [entry["path"] for entry in manifest["files"]] == files
        assert any(name.endswith(".distcp") for name in files) and ".metadata" in files
        for entry in manifest["files"]:
            data = (path / entry["path"]).read_bytes()
            assert entry["bytes"] == len(data)
            assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert manifest["bytes"] == sum(entry["bytes"] for entry in manifest["files"])
        step = manifest["step"]
        assert path.name == f"step-{step:06d}"
        assert (manifest["run_id"], manifest["attempt"]) == (RUN_ID, int(ATTEMPT))
        assert manifest["layout"] == parse_config(fsdp2({})).parallel.model_dump()
        assert manifest["world_size"] == 2
        assert manifest["parent"] == str(directory / f"step-{step - 1:06d}")
        assert manifest["data"] == {"next_step": step + 1, "seed": 0, "dataset": None}
        assert manifest["lr_schedule"]["step"] == step and manifest["lr_schedule"]["total_steps"] == STEPS
        assert manifest["loss"] == losses[step - 1]
        assert len(base64.b64decode(manifest["rng"]["cpu"])) == torch.get_rng_state().numel()
        assert manifest["rng"]["cuda"] is None


@pytest.mark.slow
def test_resuming_halfway_repeats_the_straight_run_exactly(straight, tmp_path):
    """The resumed run also saves, by the clock and written while training waits: neither changes the math."""
    run, directory = straight
    resumed_from = directory / "step-000003"
    own_directory = tmp_path / "checkpoints"
    checkpoint = {"resume": str(resumed_from), "interval_minutes": 1e-4, "async_save": False}
    resumed = run_trainer(tmp_path, fsdp2({**checkpoint, "directory": str(own_directory)}))
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert metric_steps(resumed) == list(range(HALF + 1, STEPS + 1))
    assert resumed.loss_means() == run.loss_means()[HALF:]
    reference = run.parameters()
    assert all(torch.equal(tensor, reference[name]) for name, tensor in resumed.parameters().items())
    assert sorted(resumed.parameters()) == sorted(reference)
    (loaded,) = checkpoint_events(resumed, "loaded")
    assert loaded["step"] == HALF and loaded["path"] == str(resumed_from)
    committed = checkpoint_events(resumed, "committed")
    assert [(event["step"], event["parent"]) for event in committed] == [
        (4, str(resumed_from)),
        (5, str(own_directory / "step-000004")),
        (6, str(own_directory / "step-000005")),
    ]


@pytest.mark.slow
def test_retention_deletes_only_what_the_attempt_wrote_never_what_it_resumed_from(straight, tmp_path):
    """A run writing into a directory that holds another run's checkpoints (the trainer run by hand may be told
    to) and resuming from one of them: keep_last 1 retires its own step 6 once step 7 is committed, and leaves
    the other run's steps 3 and 5, the one it resumed from included."""
    _, directory = straight
    shared = tmp_path / "shared"
    for name in ("step-000003", "step-000005"):
        shutil.copytree(directory / name, shared / name)
    others = {name: sha256_tree(shared / name) for name in ("step-000003", "step-000005")}
    checkpoint = {"resume": str(shared / "step-000005"), "interval_steps": 1, "keep_last": 1, "directory": str(shared)}
    resumed = run_trainer(
        tmp_path, fsdp2(checkpoint, steps=7), extra_env={"LOOM_RUN_ID": "run-43", "LOOM_ATTEMPT": "8"}
    )
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert [event["step"] for event in checkpoint_events(resumed, "committed")] == [6, 7]
    assert [event["path"] for event in checkpoint_events(resumed, "deleted")] == [str(shared / "step-000006")]
    assert sorted(path.name for path in shared.iterdir()) == ["step-000003", "step-000005", "step-000007"]
    assert {name: sha256_tree(shared / name) for name in others} == others


def sha256_tree(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


@pytest.mark.slow
def test_a_checkpoint_from_before_rope_theta_resumes(straight, tmp_path):
    """Manifests written before model.rope_theta existed do not name it; their models used its default."""
    run, directory = straight
    older = tmp_path / "step-000003"
    shutil.copytree(directory / "step-000003", older)
    manifest = json.loads((older / MANIFEST).read_text())
    del manifest["model"]["rope_theta"]
    (older / MANIFEST).write_text(json.dumps(manifest))
    resumed = run_trainer(tmp_path, fsdp2({"resume": str(older), "directory": str(tmp_path / "checkpoints")}))
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed.loss_means() == run.loss_means()[HALF:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"tp": 2}, id="tp2"),
        pytest.param({"pp": 2, "pp_schedule": "1F1B", "microbatches": 2}, id="pp2_1f1b"),
    ],
)
def test_an_fsdp_checkpoint_resumes_in_another_layout(straight, tmp_path, layout):
    run, directory = straight
    resumed = run_trainer(tmp_path, document({"resume": str(directory / "step-000003")}, **layout))
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert metric_steps(resumed) == list(range(HALF + 1, STEPS + 1))
    assert_same_math(resumed, run)


@pytest.mark.slow
@pytest.mark.parametrize("named", [False, True], ids=["latest", "named_directory"])
def test_resuming_from_a_directory_falls_back_past_a_corrupt_checkpoint_never_to_an_uncommitted_one(
    straight, corrupted, tmp_path, named
):
    """The run's own directory ("latest") and a directory named in resume are searched alike."""
    run, _ = straight
    if named:
        checkpoint = {"resume": str(corrupted), "directory": str(tmp_path / "checkpoints")}
    else:
        checkpoint = {"resume": "latest", "directory": str(corrupted)}
    resumed = run_trainer(tmp_path, fsdp2(checkpoint))
    assert resumed.returncode == 0, resumed.output[-4000:]
    (corrupt,) = checkpoint_events(resumed, "corrupt")
    assert corrupt["step"] == 6 and corrupt["path"] == str(corrupted / "step-000006")
    assert corrupt["error"] == "step-000006/__0_0.distcp: sha256 mismatch"
    assert "checkpoint step-000006 is corrupt (step-000006/__0_0.distcp: sha256 mismatch)" in resumed.output
    (loaded,) = checkpoint_events(resumed, "loaded")
    assert loaded["step"] == 5
    assert metric_steps(resumed) == [6]
    assert resumed.loss_means() == run.loss_means()[5:]


@pytest.mark.slow
def test_a_named_directory_resumes_from_its_newest_checkpoint(straight, tmp_path):
    """Into one rank: the newest checkpoint (step 6, of 3, 5 and 6) is the straight run's final state."""
    run, directory = straight
    resumed = run_trainer(tmp_path, document({"resume": str(directory), "directory": str(tmp_path / "checkpoints")}))
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert checkpoint_events(resumed, "corrupt") == []
    (loaded,) = checkpoint_events(resumed, "loaded")
    assert loaded["step"] == STEPS and loaded["path"] == str(directory / f"step-{STEPS:06d}")
    assert metric_steps(resumed) == []
    reference = run.parameters()
    assert sorted(resumed.parameters()) == sorted(reference)
    assert all(torch.equal(tensor, reference[name]) for name, tensor in resumed.parameters().items())


@pytest.mark.slow
def test_a_named_directory_where_no_checkpoint_verifies_fails_naming_it_and_the_first_problem(corrupted, tmp_path):
    """Whoever names a directory expects a checkpoint there: none that verifies is an error, not a fresh start."""
    directory = tmp_path / "attempt-3"
    for name in ("step-000005", "step-000006"):
        shutil.copytree(corrupted / name, directory / name)
    (directory / "step-000005" / ".metadata").unlink()
    run = run_trainer(tmp_path, document({"resume": str(directory)}))
    assert run.returncode != 0
    assert (
        f"CheckpointError: {directory}: no committed checkpoint there verifies (2 checked); "
        "the newest: step-000006/__0_0.distcp: sha256 mismatch"
    ) in run.output
    assert [(event["step"], event["error"]) for event in checkpoint_events(run, "corrupt")] == [
        (6, "step-000006/__0_0.distcp: sha256 mismatch"),
        (5, "step-000005/.metadata: missing"),
    ]
    assert run.events("metric") == []


@pytest.mark.slow
def test_an_explicit_corrupt_checkpoint_fails_naming_the_file(corrupted, tmp_path):
    run = run_trainer(tmp_path, document({"resume": str(corrupted / "step-000006")}))
    assert run.returncode != 0
    assert "CheckpointCorrupt: step-000006/__0_0.distcp: sha256 mismatch" in run.output
    assert run.events("metric") == []


@pytest.mark.slow
def test_sigterm_commits_a_checkpoint_of_the_last_completed_step(tmp_path):
    directory = tmp_path / "checkpoints"
    process = start_trainer(tmp_path, fsdp2({"interval_steps": 1000, "directory": str(directory)}, steps=100_000))
    try:
        wait_for_output(tmp_path, "step 3/", process)
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            kill_trainer(process)
    run = started_run_result(tmp_path, process)
    stopped = [event["payload"] for _, event in run.events("state") if event["payload"]["state"] == "stopped"]
    assert len(stopped) == 2 and stopped[0]["step"] == stopped[1]["step"] >= 3, run.output[-4000:]
    last_step = stopped[0]["step"]
    (checkpoint,) = committed_checkpoints(directory)
    assert checkpoint.name == f"step-{last_step:06d}"
    assert verify(checkpoint)["step"] == last_step
    (committed,) = checkpoint_events(run, "committed")
    assert committed["step"] == last_step and committed["parent"] is None


def tied(document: dict) -> dict:
    document["model"]["tie_embeddings"] = True
    return document


@pytest.fixture(scope="module")
def tied_straight(tmp_path_factory) -> tuple[FinishedRun, Path]:
    """A tied model under FSDP 2, STEPS steps, a checkpoint every HALF."""
    workdir = tmp_path_factory.mktemp("tied-straight")
    directory = workdir / "checkpoints"
    run = run_trainer(workdir, tied(fsdp2({"interval_steps": HALF, "directory": str(directory)})))
    assert run.returncode == 0, run.output[-4000:]
    return run, directory


def assert_one_matrix(run: FinishedRun) -> None:
    parameters = run.parameters()
    assert torch.equal(parameters["embedding.weight"], parameters["output.weight"])


@pytest.mark.slow
def test_a_tied_models_checkpoint_resumes_in_another_layout(tied_straight, tmp_path):
    """One parameter under two names (embedding and output): FSDP saves it, tensor parallelism, which splits it over
    the vocabulary for both layers, loads it and trains on as the straight run did."""
    straight, directory = tied_straight
    resumed = run_trainer(tmp_path, tied(document({"resume": str(directory / "step-000003")}, tp=2)))
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert metric_steps(resumed) == list(range(HALF + 1, STEPS + 1))
    assert_same_math(resumed, straight)
    assert_one_matrix(resumed)


@pytest.mark.slow
def test_a_tied_models_checkpoint_resumes_across_pipeline_stages_and_back(tied_straight, tmp_path):
    """The one tied parameter of a single stage resumes as the first stage's embedding and the last stage's copy of
    it, optimizer states included; that pipeline's checkpoint, a step later, resumes as one parameter again."""
    straight, directory = tied_straight
    staged_directory = tmp_path / "staged-checkpoints"
    staged = run_trainer(
        tmp_path / "staged",
        tied(
            document(
                {"resume": str(directory / "step-000003"), "interval_steps": 1, "directory": str(staged_directory)},
                pp=2,
                pp_schedule="1F1B",
                microbatches=2,
            )
        ),
    )
    assert staged.returncode == 0, staged.output[-4000:]
    assert_same_math(staged, straight)
    assert_one_matrix(staged)
    whole = run_trainer(tmp_path / "whole", tied(document({"resume": str(staged_directory / "step-000004")})))
    assert whole.returncode == 0, whole.output[-4000:]
    assert metric_steps(whole) == list(range(HALF + 2, STEPS + 1))
    assert_same_math(whole, straight, resumed_after=HALF + 1)
    assert_one_matrix(whole)


@pytest.mark.slow
def test_a_mixture_of_experts_checkpoint_resumes_with_its_experts_spread_another_way(tmp_path):
    """Saved with each rank holding half of every block's experts (expert parallelism), resumed with each rank
    holding half of every expert's columns (tensor parallelism): the experts, their optimizer states and the routing
    biases carry over."""
    moe = {"experts": 4, "top_k": 2, "moe": {"balance_loss": 0.05, "bias_update_rate": 0.01}}
    directory = tmp_path / "checkpoints"
    saving = fsdp2({"interval_steps": HALF, "directory": str(directory)}, ep=2)
    saving["model"].update(moe)
    straight = run_trainer(tmp_path / "straight", saving)
    assert straight.returncode == 0, straight.output[-4000:]
    resuming = document({"resume": str(directory / "step-000003")}, tp=2)
    resuming["model"].update(moe)
    resumed = run_trainer(tmp_path / "resumed", resuming)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert metric_steps(resumed) == list(range(HALF + 1, STEPS + 1))
    assert_same_math(resumed, straight)
