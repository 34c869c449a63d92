"""In a real Chromium: the Datasets page registers a prepared dataset (a path outside the data roots refused beside
its field) and shows its token counts and decoded samples; the new-run form offers the dataset and the starting
weights, the run made with them says on its page what it trains on and starts from, and its lineage has the
model as its root; the designer's choosers fill the model's shape from the weights and its vocabulary from the
dataset; the checkpoints table's Export button queues an export of the checkpoint."""

import re

import pytest
from playwright.sync_api import expect

from loom.datasets.models import READY, PretrainedModel
from loom.datasets.services import register_dataset
from tests.platform.helpers import BatchSender, checkpoint_event, claimed_run, own_checkpoint
from tests.platform.test_datasets import DOCUMENTS, text_dataset
from trainer.config import ModelConfig

from .tiny_run import TINY_RUN_INPUTS

pytestmark = pytest.mark.e2e

VIEWPORT = {"width": 1280, "height": 900}
TRAIN_TOKENS = sum(len(text) + 1 for text in DOCUMENTS)


@pytest.fixture
def data_root(settings, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    settings.LOOM_DATA_ROOTS = [root]
    return root


@pytest.fixture
def sources(platform_user, data_root, tmp_path):
    """A registered dataset and an imported model of the platform user's, made before the browser starts."""
    user = platform_user[0]
    dataset = register_dataset(user, "stdlib bytes", str(text_dataset(data_root / "bytes")))
    shape = ModelConfig(layers=2, dim=64, heads=4, kv_heads=2, ffn=172, vocab=257)
    model = PretrainedModel.objects.create(
        owner=user,
        name="tiny llama",
        source_path=str(data_root / "tiny-llama"),
        checkpoint_path=str(tmp_path / "models" / "model-1"),
        model_config=shape.model_dump(mode="json"),
        state=READY,
    )
    return dataset, model


def test_a_dataset_registered_on_the_page_shows_its_counts_and_samples(sources, data_root, tmp_path, open_logged_in):
    fox, outside = text_dataset(data_root / "fox"), text_dataset(tmp_path / "outside")
    page = open_logged_in("/", VIEWPORT)
    page.locator("nav a", has_text="Datasets").click()
    page.wait_for_url("**/datasets/")
    expect(page.locator("#datasets tbody tr", has_text="stdlib bytes")).to_be_visible()

    form = page.locator("#register-dataset")
    form.locator("[name=name]").fill("fox")
    form.locator("[name=path]").fill(str(outside))
    form.locator("button[type=submit]").click()
    expect(form.locator('.field-error[data-for="path"]')).to_contain_text("must lie inside one of the data roots")
    expect(page.locator("#datasets tbody tr", has_text="fox")).to_have_count(0)

    form.locator("[name=path]").fill(str(fox))
    form.locator("button[type=submit]").click()
    row = page.locator("#datasets tbody tr", has_text="fox")
    expect(row.locator(".train-tokens")).to_have_text(str(TRAIN_TOKENS))
    expect(row.locator(".validation-tokens")).to_have_text(str(len(b"Validation text.") + 1))

    row.locator("a", has_text="fox").click()
    page.wait_for_url(re.compile(r"/datasets/\d+/$"))
    expect(page.locator("#train-tokens")).to_have_text(str(TRAIN_TOKENS))
    expect(page.locator("#tokenizer")).to_have_text("bytes, vocabulary 257")
    expect(page.locator("#samples li")).to_have_count(3)
    expect(page.locator("#samples pre").first).to_contain_text("The quick brown fox jumps over the lazy dog.")
    expect(page.locator("#dataset-runs")).to_contain_text("No run has trained on it yet.")


def test_the_new_run_form_offers_the_dataset_and_the_starting_weights(sources, open_logged_in):
    dataset, model = sources
    page = open_logged_in("/runs/new/", VIEWPORT)
    dataset_select, init_select = page.locator('[name="data.dataset"]'), page.locator('[name="checkpoint.init_from"]')
    expect(dataset_select.locator("option")).to_have_text(
        ["the demo corpus (Python's standard library, byte-level)", re.compile(r"^stdlib bytes \(")]
    )
    expect(init_select.locator("option")).to_have_text(["fresh weights", "tiny llama (imported model)"])

    page.fill('[name="name"]', "fine-tune")
    for path, value in TINY_RUN_INPUTS.items():
        page.fill(f'[name="{path}"]', value)
    # A dataset raises the vocabulary to hold its tokenizer's ids; starting weights set the shape they fix.
    dataset_select.select_option(dataset.reference)
    expect(page.locator('[name="model.vocab"]')).to_have_value("257")
    page.fill('[name="model.dim"]', "128")
    init_select.select_option(model.reference)
    expect(page.locator('[name="model.dim"]')).to_have_value("64")
    expect(page.locator('[name="model.seq_len"]')).to_have_value(TINY_RUN_INPUTS["model.seq_len"])
    page.fill('[name="model.vocab"]', "256")
    page.click("button:has-text('Create run')")
    # A vocabulary set below the dataset's: refused beside its field, the choices kept.
    expect(page.locator('.field-error[data-for="model.vocab"]')).to_contain_text("must be at least 257")
    expect(dataset_select).to_have_value(dataset.reference)

    page.fill('[name="model.vocab"]', "257")
    page.click("button:has-text('Create run')")
    page.wait_for_url(re.compile(r"/runs/\d+/$"))
    expect(page.locator("#run-dataset")).to_contain_text("Trains on stdlib bytes")
    expect(page.locator("#run-source")).to_contain_text("Starts from the imported model tiny llama")

    # The lineage draws the imported model as the root the run started from.
    page.click("#lineage-link")
    page.wait_for_function("window.loomLineage && window.loomLineage.ready")
    expect(page.locator(f'.lineage-model[data-model="{model.pk}"]')).to_contain_text("tiny llama")
    expect(page.locator('path[data-edge="init"]')).to_have_count(1)


def test_the_designer_chooses_a_dataset_and_weights_that_set_the_model(sources, open_logged_in):
    dataset, model = sources
    page = open_logged_in("/plan/", VIEWPORT)
    page.wait_for_function("window.loomDesign?.estimate", timeout=60_000)
    page.locator("#design-init-from").select_option(model.reference)
    expect(page.locator("#design-model-dim")).to_have_value("64")
    expect(page.locator("#design-model-layers")).to_have_value("2")
    page.locator("#design-dataset").select_option(dataset.reference)
    expect(page.locator("#design-model-vocab")).to_have_value("257")


@pytest.fixture
def committed_checkpoint(platform_user, runs_dir):
    """A run of the platform user's with one committed checkpoint, made before the browser starts."""
    run, attempt, _ = claimed_run(platform_user[0], "exportable")
    BatchSender(attempt).send(0, checkpoint_event("committed", 5, own_checkpoint(attempt, 5), bytes=1, world_size=2))
    return run.checkpoints.get()


def test_the_checkpoints_table_exports_a_checkpoint(committed_checkpoint, open_logged_in):
    page = open_logged_in(f"/runs/{committed_checkpoint.run_id}/", VIEWPORT)
    page.wait_for_function("window.loomRun && window.loomRun.detail !== null")
    page.locator(f"#checkpoint-{committed_checkpoint.pk} .export-button").click()
    # No worker runs here: the export is queued, and the page says it is under way.
    expect(page.locator("#page-notice")).to_have_text("Exporting the checkpoint of step 5 to Hugging Face's format…")
    assert page.evaluate("async () => (await (await fetch('/api/exports')).json()).map((job) => job.step)") == [5]
