"""Datasets, imported models and exports through the API: registered from inside the data roots only, each user's
own, named by reference in a run config and turned into directories only in the config an attempt's ranks read;
a real worker converts a Hugging Face Llama into a checkpoint and exports a committed one back."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from celery.contrib.testing.worker import start_worker

from loom.celery import app as celery_app
from loom.datasets.models import READY, CheckpointExport, Dataset, PretrainedModel
from loom.runs.launcher import claim_attempt, trainer_config, work_dir_for
from loom.runs.models import Run
from tests.trainer.token_dataset import write_token_dataset

from ..conftest import wait_for
from .helpers import TINY_CONFIG, BatchSender, checkpoint_event, own_checkpoint
from .test_api import api

pytestmark = pytest.mark.django_db

DOCUMENTS = [b"The quick brown fox jumps over the lazy dog. " * 4, b"Pack my box with five dozen liquor jugs. " * 4]
HF_SHAPE = {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 172, "vocab": 320}


@pytest.fixture
def data_root(settings, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    settings.LOOM_DATA_ROOTS = [root]
    settings.LOOM_MODELS_DIR = tmp_path / "models"
    settings.LOOM_EXPORTS_DIR = tmp_path / "exports"
    return root


def byte_documents(texts) -> list[np.ndarray]:
    return [np.frombuffer(text, dtype=np.uint8) for text in texts]


def text_dataset(directory: Path, **kwargs) -> Path:
    splits = {"train": byte_documents(DOCUMENTS), "validation": byte_documents([b"Validation text."])}
    return write_token_dataset(directory, splits, shard_tokens=200, **kwargs)


def register(client, token, name, path):
    return api(client, "post", "/api/datasets", token, {"name": name, "path": str(path)})


def run_body(name, **sections):
    config = json.loads(json.dumps(TINY_CONFIG))
    for section, fields in sections.items():
        config[section] = {**config.get(section, {}), **fields}
    return {"name": name, "config": config}


def test_a_registered_dataset_lists_its_counts_tokenizer_and_samples_and_the_runs_that_trained_on_it(
    client, platform_user, token_for, data_root, runs_dir
):
    user = platform_user[0]
    token = token_for(user)
    path = text_dataset(data_root / "fox")
    train_tokens = sum(len(text) + 1 for text in DOCUMENTS)

    response = register(client, token, "fox", path)
    assert response.status_code == 201, response.content
    registered = response.json()
    assert registered["reference"] == f"dataset:{registered['id']}"
    assert registered["splits"] == {
        "train": {"tokens": train_tokens, "documents": 2},
        "validation": {"tokens": len(b"Validation text.") + 1, "documents": 1},
    }
    assert (registered["vocab_size"], registered["tokenizer"]["kind"], registered["shards"]) == (257, "bytes", 3)
    assert [item["id"] for item in api(client, "get", "/api/datasets", token).json()] == [registered["id"]]

    # Byte-level tokens and the end-of-text token: 257 ids.
    body = run_body("on fox", data={"dataset": registered["reference"]}, model={"vocab": 257})
    created = api(client, "post", "/api/runs", token, body)
    assert created.status_code == 201, created.content
    run = Run.objects.get(pk=created.json()["id"])
    assert run.config["data"]["dataset"] == registered["reference"]
    assert run.dataset_id == registered["id"]
    attempt, _ = claim_attempt(run.attempts.get().pk)
    assert trainer_config(attempt, work_dir_for(attempt))["data"]["dataset"] == str(path)

    detail = api(client, "get", f"/api/datasets/{registered['id']}", token).json()
    assert detail["runs"] == [{"id": run.pk, "name": "on fox", "state": "starting"}]
    texts = [sample["text"] for sample in detail["samples"]]
    assert len(texts) == 3 and texts[0].startswith("The quick brown fox jumps")
    assert "<|endoftext|>Pack my box" in "".join(texts)
    assert all(len(sample["tokens"]) == 96 for sample in detail["samples"])


def test_paths_outside_the_data_roots_and_what_is_no_dataset_are_refused_by_field(
    client, platform_user, token_for, data_root, tmp_path
):
    token = token_for(platform_user[0])
    outside = text_dataset(tmp_path / "outside")
    (data_root / "escape").symlink_to(outside)
    (data_root / "empty").mkdir()
    sneaky = text_dataset(data_root / "sneaky")
    manifest = json.loads((sneaky / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["file"] = "../outside/train-000000.bin"
    (sneaky / "manifest.json").write_text(json.dumps(manifest))

    def refusal(name, path):
        response = register(client, token, name, path)
        assert response.status_code == 400, response.content
        return response.json()["errors"]

    assert refusal("outside", outside)["path"].startswith(f"must lie inside one of the data roots ({data_root}")
    assert refusal("escape", data_root / "escape")["path"].startswith("must lie inside one of the data roots")
    assert refusal("relative", "data/fox")["path"] == "must be an absolute path, not 'data/fox'"
    assert "not a prepared dataset" in refusal("empty", data_root / "empty")["path"]
    assert "no file name inside the dataset's directory" in refusal("sneaky", sneaky)["path"]
    errors = refusal("", data_root / "missing")
    assert errors["name"] == "is required" and "must lie inside" not in errors["path"]
    assert not Dataset.objects.exists()


def test_another_users_dataset_reads_as_missing(client, platform_user, other_user, token_for, data_root):
    theirs = register(client, token_for(other_user), "theirs", text_dataset(data_root / "theirs")).json()
    token = token_for(platform_user[0])
    assert api(client, "get", f"/api/datasets/{theirs['id']}", token).status_code == 404
    assert api(client, "get", "/api/datasets", token).json() == []
    response = api(client, "post", "/api/runs", token, run_body("borrowed", data={"dataset": theirs["reference"]}))
    assert response.status_code == 400
    assert response.json()["errors"] == {
        "config.data.dataset": f"you have no dataset {theirs['id']}; register it on the Datasets page"
    }


def test_a_run_is_refused_a_small_vocabulary_a_missing_dataset_and_paths_where_references_belong(
    client, platform_user, token_for, data_root
):
    token = token_for(platform_user[0])
    wide = register(client, token, "wide", text_dataset(data_root / "wide", vocab_size=1000, eot_id=999)).json()

    def refusal(**sections):
        response = api(client, "post", "/api/runs", token, run_body("refused", **sections))
        assert response.status_code == 400, response.content
        return response.json()["errors"]

    assert refusal(data={"dataset": wide["reference"]}) == {
        "config.model.vocab": f"must be at least 1000, the size of dataset {wide['id']}'s tokenizer (bytes), so "
        "every token id it holds has an embedding"
    }
    assert refusal(data={"dataset": "dataset:999999"}) == {
        "config.data.dataset": "you have no dataset 999999; register it on the Datasets page"
    }
    assert refusal(data={"dataset": str(data_root / "wide")})["config.data.dataset"].startswith("cannot be a path")
    assert refusal(checkpoint={"init_from": "/tmp/weights"})["config.checkpoint.init_from"].startswith(
        "cannot be a path"
    )
    assert refusal(checkpoint={"init_from": "model:999999"}) == {
        "config.checkpoint.init_from": "you have no imported model 999999"
    }
    assert not Run.objects.exists()


def worker():
    """A real Celery worker in a thread, taking this session's queue."""
    return start_worker(celery_app, pool="threads", concurrency=1, perform_ping_check=False, loglevel="WARNING")


def tiny_llama(directory: Path):
    """A randomly initialised Llama of HF_SHAPE, saved as Hugging Face does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=HF_SHAPE["vocab"],
        hidden_size=HF_SHAPE["dim"],
        intermediate_size=HF_SHAPE["ffn"],
        num_hidden_layers=HF_SHAPE["layers"],
        num_attention_heads=HF_SHAPE["heads"],
        num_key_value_heads=HF_SHAPE["kv_heads"],
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return model


@pytest.mark.django_db(transaction=True)
def test_a_hugging_face_llama_is_imported_started_from_and_a_committed_checkpoint_exported_by_a_real_worker(
    client, platform_user, other_user, token_for, data_root, runs_dir
):
    import torch
    from transformers import AutoModelForCausalLM

    user = platform_user[0]
    token, their_token = token_for(user), token_for(other_user)
    original = tiny_llama(data_root / "tiny-llama")
    assert api(client, "post", "/api/models", token, {"name": "tiny", "path": "/etc"}).json()["errors"]["path"]

    with worker():
        response = api(client, "post", "/api/models", token, {"name": "tiny", "path": str(data_root / "tiny-llama")})
        assert response.status_code == 202, response.content
        model_id = response.json()["id"]
        model = wait_for(
            lambda: PretrainedModel.objects.filter(pk=model_id).exclude(state__in=["queued", "converting"]).first(),
            timeout=120,
            message="the import to finish",
        )
    assert (model.state, model.error) == (READY, "")
    assert {field: model.model_config[field] for field in HF_SHAPE} == HF_SHAPE
    assert api(client, "get", f"/api/models/{model_id}", their_token).status_code == 404

    shape = {**model.model_config, "seq_len": 64}
    body = run_body("wrong shape", model={**shape, "dim": 128}, checkpoint={"init_from": f"model:{model_id}"})
    mismatched = api(client, "post", "/api/runs", token, body)
    assert "dim is 64 there, 128 here" in mismatched.json()["errors"]["config.checkpoint.init_from"]
    body = run_body("from tiny", model=shape, checkpoint={"init_from": f"model:{model_id}"})
    created = api(client, "post", "/api/runs", token, body)
    assert created.status_code == 201, created.content
    run = Run.objects.get(pk=created.json()["id"])
    assert (run.pretrained_id, run.config["checkpoint"]["init_from"]) == (model_id, f"model:{model_id}")
    # Claimed here, with no worker running, so no worker launches it: the next one finds it taken.
    attempt, _ = claim_attempt(run.attempts.get().pk)
    assert trainer_config(attempt, work_dir_for(attempt))["checkpoint"]["init_from"] == model.checkpoint_path

    # The run's first save, as its ranks would commit it: the imported weights, unchanged.
    saved = own_checkpoint(attempt, 1)
    shutil.copytree(model.checkpoint_path, saved)
    BatchSender(attempt).send(0, checkpoint_event("committed", 1, saved, bytes=1, world_size=1))
    checkpoint = run.checkpoints.get()
    export_url = f"/api/checkpoints/{checkpoint.pk}/export"
    assert api(client, "post", export_url, their_token, {}).status_code == 404
    refused = api(client, "post", export_url, token, {"dtype": "int3"})
    assert refused.json()["errors"] == {"dtype": "must be one of float32, bfloat16, float16"}
    with worker():
        response = api(client, "post", export_url, token, {})
        assert response.status_code == 202, response.content
        export = wait_for(
            lambda: CheckpointExport.objects.filter(pk=response.json()["id"], state__in=[READY, "failed"]).first(),
            timeout=120,
            message="the export to finish",
        )
    assert (export.state, export.error) == (READY, "")

    assert api(client, "get", f"/api/exports/{export.pk}", token).json()["out_path"] == export.out_path
    assert api(client, "get", f"/api/exports/{export.pk}", their_token).status_code == 404
    exported = AutoModelForCausalLM.from_pretrained(export.out_path)
    ids = torch.tensor([[1, 5, 9, 300, 42]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, original(ids).logits)


def test_the_lineage_has_an_imported_model_as_the_root_of_the_runs_started_from_it(
    client, platform_user, token_for, data_root
):
    user = platform_user[0]
    token = token_for(user)
    shape = {**HF_SHAPE, "seq_len": 64}
    model = PretrainedModel.objects.create(
        owner=user, name="tiny", source_path=str(data_root / "tiny-llama"), model_config=shape, state=READY
    )
    started = [
        api(client, "post", "/api/runs", token, run_body(name, model=shape, checkpoint={"init_from": model.reference}))
        for name in ("first fine-tune", "second fine-tune")
    ]
    fresh = api(client, "post", "/api/runs", token, run_body("fresh"))
    lineage = api(client, "get", f"/api/runs/{started[0].json()['id']}/lineage", token).json()
    assert lineage["models"] == [
        {"id": model.pk, "name": "tiny", "source_path": model.source_path, "reference": model.reference}
    ]
    assert [(run["id"], run["pretrained"]) for run in lineage["runs"]] == [
        (response.json()["id"], model.pk) for response in started
    ]
    alone = api(client, "get", f"/api/runs/{fresh.json()['id']}/lineage", token).json()
    assert (alone["models"], [run["pretrained"] for run in alone["runs"]]) == ([], [None])


def test_a_model_directory_with_a_weights_file_linked_out_of_the_roots_is_refused(
    client, platform_user, token_for, data_root, tmp_path
):
    token = token_for(platform_user[0])
    outside = tmp_path / "outside-weights"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"not for you")
    model_dir = data_root / "linked-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").symlink_to(outside / "model.safetensors")

    response = api(client, "post", "/api/models", token, {"name": "linked", "path": str(model_dir)})
    assert response.status_code == 400, response.content
    assert response.json()["errors"] == {
        "path": "model.safetensors is a link out of the data roots; copy the file in instead"
    }
    assert not PretrainedModel.objects.exists()


def test_a_dataset_swapped_for_a_link_out_of_the_roots_after_registering_shows_no_samples(
    client, platform_user, token_for, data_root, tmp_path
):
    token = token_for(platform_user[0])
    registered = register(client, token, "fox", text_dataset(data_root / "fox")).json()
    secret = text_dataset(tmp_path / "secret")
    shutil.rmtree(data_root / "fox")
    (data_root / "fox").symlink_to(secret)

    detail = api(client, "get", f"/api/datasets/{registered['id']}", token).json()
    assert detail["samples"] == []
    assert "must lie inside one of the data roots" in detail["samples_problem"]


def test_a_run_from_imported_weights_takes_the_model_fields_it_leaves_out_from_them(
    client, platform_user, token_for, data_root
):
    """An imported Llama fixes fields no form asks for (its norm epsilon, its RoPE base and scaling): a config
    that names the weights and leaves those out gets theirs; one that states another value is refused."""
    user = platform_user[0]
    token = token_for(user)
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context": 8192}
    saved = {**HF_SHAPE, "seq_len": 8192, "rope_theta": 500_000.0, "norm_eps": 1e-6, "rope_scaling": scaling}
    model = PretrainedModel.objects.create(
        owner=user, name="llama", source_path=str(data_root / "llama"), model_config=saved, state=READY
    )
    shape = {field: HF_SHAPE[field] for field in ("layers", "dim", "heads", "kv_heads", "ffn")}
    body = run_body("from llama", model={**shape, "seq_len": 64}, checkpoint={"init_from": model.reference})
    created = api(client, "post", "/api/runs", token, body)
    assert created.status_code == 201, created.content
    stored = Run.objects.get(pk=created.json()["id"]).config["model"]
    assert (stored["seq_len"], stored["vocab"], stored["norm_eps"]) == (64, HF_SHAPE["vocab"], 1e-6)
    assert (stored["rope_theta"], stored["rope_scaling"]) == (500_000.0, scaling)

    body = run_body("other eps", model={**shape, "norm_eps": 1e-5}, checkpoint={"init_from": model.reference})
    refused = api(client, "post", "/api/runs", token, body)
    assert "norm_eps is 1e-06 there, 1e-05 here" in refused.json()["errors"]["config.checkpoint.init_from"]
