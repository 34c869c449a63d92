"""The server-rendered pages through Django's test client: access, the new-run form, logging out.

The `db` fixture is not transactional, so create_run's on-commit launch never fires here: runs stay queued.
"""

import re

import pytest
from django.test import Client

from loom.runs.forms import NewRunForm, input_for
from loom.runs.hardware import launch_gpus
from loom.runs.models import Run
from loom.runs.services import cancel_run, create_run

from .tiny_run import TINY_RUN_INPUTS

TINY_FORM = {
    **{path: field.initial for path, field in NewRunForm().fields.items()},
    "name": "tiny",
    "steps": "30",
    **TINY_RUN_INPUTS,
    "optimizer.lr": "0.003",
    "optimizer.warmup_steps": "2",
}


@pytest.fixture
def ada(django_user_model):
    return django_user_model.objects.create_user("ada", password="pw-ada")


@pytest.fixture
def logged_in(client, ada):
    client.force_login(ada)
    return client


@pytest.fixture
def adas_run(ada):
    return create_run(ada, "ada's run", {"parallel": {"dp_replicate": 2}})


def field_errors(response, name: str) -> list[str]:
    return response.context["form"].errors.get(name, [])


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/", "/runs/new/", "/runs/{run}/"])
def test_anonymous_requests_are_sent_to_log_in(client, adas_run, path):
    path = path.format(run=adas_run.pk)
    response = client.get(path)
    assert response.status_code == 302
    assert response["Location"] == f"/login/?next={path}"


@pytest.mark.django_db
def test_anonymous_post_to_new_run_creates_nothing(client):
    response = client.post("/runs/new/", TINY_FORM)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")
    assert not Run.objects.exists()


@pytest.mark.django_db
def test_logging_in_through_the_form_lands_on_the_run_list(client, ada):
    page = client.get("/login/")
    assert page.status_code == 200
    assert b'name="username"' in page.content and b'name="password"' in page.content
    refused = client.post("/login/", {"username": "ada", "password": "wrong"})
    assert refused.status_code == 200
    assert "Please enter a correct username and password" in refused.content.decode()
    response = client.post("/login/", {"username": "ada", "password": "pw-ada"})
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200


@pytest.mark.django_db
def test_run_list_shows_only_the_users_runs(logged_in, adas_run, django_user_model):
    create_run(django_user_model.objects.create_user("mallory"), "mallory's secret run", {})
    page = logged_in.get("/").content.decode()
    assert f'href="/runs/{adas_run.pk}/"' in page
    assert "ada&#x27;s run" in page
    assert 'class="badge state-queued"' in page
    assert "mallory" not in page
    assert 'href="/runs/new/"' in page


@pytest.mark.django_db
def test_run_list_shows_the_newest_run_first_as_the_api_does(logged_in, ada):
    runs = [create_run(ada, name, {}) for name in ("first", "second", "third")]
    page = logged_in.get("/").content.decode()
    listed = [int(run_id) for run_id in re.findall(r'<tr data-run="(\d+)">', page)]
    assert listed == [run.pk for run in reversed(runs)]
    assert [run["id"] for run in logged_in.get("/api/runs").json()["runs"]] == listed
    assert logged_in.get("/runs/", follow=True).redirect_chain == [("/", 302)]


@pytest.mark.django_db
def test_run_list_names_a_bad_filter_instead_of_listing_runs(logged_in, adas_run):
    response = logged_in.get("/?state=sleeping&sort=size&cursor=nope")
    assert response.status_code == 400
    page = response.content.decode()
    assert "state: unknown states [&#x27;sleeping&#x27;]" in page and "sort: cannot sort by" in page
    assert f'data-run="{adas_run.pk}"' not in page


@pytest.mark.django_db
def test_another_users_run_page_is_not_found(client, adas_run, django_user_model):
    client.force_login(django_user_model.objects.create_user("mallory"))
    assert client.get(f"/runs/{adas_run.pk}/").status_code == 404
    assert client.get(f"/runs/{adas_run.pk + 1000}/").status_code == 404


@pytest.mark.django_db
def test_run_page_shows_the_run_and_what_its_script_needs(logged_in, adas_run):
    response = logged_in.get(f"/runs/{adas_run.pk}/")
    assert response.status_code == 200
    page = response.content.decode()
    assert 'id="run-state">queued</span>' in page
    assert '<tr data-attempt="1">' in page
    assert "/static/plotly/plotly.min.js" in page and "/static/run.js" in page
    assert response.context["page"]["ranks"] == 2
    assert response.context["page"]["apiUrl"] == f"/api/runs/{adas_run.pk}"
    assert list(response.context["ranks"]) == [0, 1]
    assert '<button type="button" id="cancel-run" class="danger">' in page


@pytest.mark.django_db
def test_finished_run_page_hides_cancel_and_shows_why_it_ended(logged_in, adas_run):
    cancel_run(adas_run)
    page = logged_in.get(f"/runs/{adas_run.pk}/").content.decode()
    assert 'id="run-state">cancelled</span>' in page
    assert 'id="cancel-run" class="danger" hidden>' in page
    assert "<pre>cancelled by user</pre>" in page


@pytest.mark.django_db
def test_static_files_the_pages_load_are_served(logged_in):
    for path in ["/static/loom.css", "/static/run.js", "/static/plotly/plotly.min.js"]:
        response = logged_in.get(path)
        assert response.status_code == 200, path
        b"".join(response.streaming_content)


@pytest.mark.django_db
def test_new_run_form_is_prefilled_with_schema_defaults_and_help(logged_in):
    response = logged_in.get("/runs/new/")
    assert response.status_code == 200
    form = response.context["form"]
    assert form["model.heads"].value() == "4"
    assert form["optimizer.lr"].value() == "0.003"
    page = response.content.decode()
    assert 'name="model.heads" value="4"' in page
    assert "Attention (query) heads; must divide dim." in page
    assert 'name="csrfmiddlewaretoken"' in page


@pytest.mark.django_db
def test_invalid_form_shows_each_error_next_to_its_field_and_keeps_values(logged_in):
    response = logged_in.post("/runs/new/", {**TINY_FORM, "model.dim": "128", "model.heads": "3", "steps": "abc"})
    assert response.status_code == 400
    assert field_errors(response, "model.heads") == [
        "must divide dim=128; valid choices include [1, 2, 4, 8, 16, 32, 64]"
    ]
    assert field_errors(response, "steps") == ['must be a valid integer, not "abc"']
    assert field_errors(response, "model.layers") == []
    page = response.content.decode()
    heads_input = page.split('<label for="id_model.heads">')[1].split("</div>")[0]
    assert 'value="3"' in heads_input
    assert "must divide dim=128" in heads_input
    assert 'name="steps" value="abc"' in page
    assert not Run.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "typed", "message"),
    [
        ("parallel.dp_replicate", "1.5", "valid integer"),
        ("model.layers", "", "valid integer"),
        ("optimizer.lr", "fast", "valid number"),
        ("optimizer.lr", "0", "greater than 0"),
        ("data.corpus_bytes", "10", "greater than or equal to 10000"),
    ],
)
def test_each_bad_value_is_reported_by_the_schema_on_its_field(logged_in, field, typed, message):
    response = logged_in.post("/runs/new/", {**TINY_FORM, field: typed})
    assert response.status_code == 400
    assert message in " ".join(field_errors(response, field))
    assert not Run.objects.exists()


@pytest.mark.django_db
def test_an_input_left_out_of_the_post_is_reported_on_its_field(logged_in):
    response = logged_in.post("/runs/new/", {key: value for key, value in TINY_FORM.items() if key != "model.ffn"})
    assert response.status_code == 400
    assert "valid integer" in " ".join(field_errors(response, "model.ffn"))
    assert not Run.objects.exists()


@pytest.mark.django_db
def test_missing_name_is_reported_on_the_name_field(logged_in):
    response = logged_in.post("/runs/new/", {**TINY_FORM, "name": "  "})
    assert response.status_code == 400
    assert field_errors(response, "name") == ["is required"]
    assert not Run.objects.exists()


def test_service_error_keys_map_to_their_inputs_or_to_the_top_of_the_form():
    assert input_for("config.model.heads") == "model.heads"
    assert input_for("name") == "name"
    assert input_for("config.checkpoint.resume") is None
    assert input_for("config") is None


@pytest.mark.django_db
def test_valid_form_creates_the_run_and_opens_its_page(logged_in, ada):
    response = logged_in.post("/runs/new/", TINY_FORM)
    run = Run.objects.get()
    assert response.status_code == 302
    assert response["Location"] == f"/runs/{run.pk}/"
    assert run.owner == ada and run.name == "tiny" and run.state == "queued"
    assert run.config["steps"] == 30
    assert run.config["model"] == {
        "layers": 2,
        "dim": 64,
        "heads": 4,
        "kv_heads": 2,
        "ffn": 172,
        "vocab": 256,
        "seq_len": 64,
        "mlp": "swiglu",
        "tie_embeddings": False,
        "parallel_blocks": False,
        "experts": 1,
        "top_k": 1,
        "moe": {
            "gate": "softmax",
            "renormalize": True,
            "balance_loss": 0.01,
            "bias_update_rate": 0.0,
            "shared_expert": False,
            "capacity_factor": None,
            "dense_layers": 0,
            "dense_ffn": None,
        },
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "rope_scaling": None,
    }
    assert run.config["parallel"]["dp_replicate"] == 2
    assert run.config["optimizer"]["lr"] == 0.003 and run.config["optimizer"]["warmup_steps"] == 2
    assert run.config["data"]["micro_batch"] == 4 and run.config["data"]["corpus_bytes"] == 300000
    assert run.attempts.get().number == 1


@pytest.mark.django_db
def test_a_run_created_in_bf16_for_a_launcher_without_a_gpu_says_so_once_on_its_page(logged_in):
    response = logged_in.post("/runs/new/", {**TINY_FORM, "compute.precision": "bf16"}, follow=True)
    run = Run.objects.get()
    assert response.redirect_chain == [(f"/runs/{run.pk}/", 302)]
    assert run.config["compute"]["precision"] == "bf16"
    page = response.content.decode()
    warning = "Precision: bf16 but the launcher has no GPU"
    assert (warning in page) == (not launch_gpus())
    assert warning not in logged_in.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="launch-warnings"' not in logged_in.post("/runs/new/", TINY_FORM, follow=True).content.decode()


@pytest.mark.django_db
def test_new_run_form_requires_csrf(ada):
    client = Client(enforce_csrf_checks=True)
    client.force_login(ada)
    assert client.post("/runs/new/", TINY_FORM).status_code == 403
    assert not Run.objects.exists()


@pytest.mark.django_db
def test_logout_ends_the_session(logged_in):
    assert logged_in.get("/").status_code == 200
    assert logged_in.get("/logout/").status_code == 405
    response = logged_in.post("/logout/")
    assert response.status_code == 302 and response["Location"] == "/login/"
    assert logged_in.get("/").status_code == 302


@pytest.mark.django_db
def test_the_form_takes_the_global_batch_of_a_recipe_and_a_validation_interval(logged_in):
    """micro_batch 4 on 2 replicas is 8 sequences a pass: a global batch of 32 is 4 accumulation passes."""
    response = logged_in.post(
        "/runs/new/", {**TINY_FORM, "data.global_batch": "32", "eval.interval_steps": "10", "eval.batches": "2"}
    )
    assert response.status_code == 302
    run = Run.objects.get()
    assert run.config["data"]["global_batch"] == 32 and run.config["eval"] == {"interval_steps": 10, "batches": 2}


@pytest.mark.django_db
def test_an_empty_global_batch_is_one_pass_and_one_that_passes_do_not_divide_is_refused_on_its_field(logged_in):
    logged_in.post("/runs/new/", {**TINY_FORM, "data.global_batch": ""})
    assert Run.objects.get().config["data"]["global_batch"] is None
    Run.objects.all().delete()

    response = logged_in.post("/runs/new/", {**TINY_FORM, "data.global_batch": "20"})
    assert response.status_code == 400
    message = " ".join(field_errors(response, "data.global_batch"))
    assert "must be a multiple of data.micro_batch × data-parallel ranks = 4 × 2 = 8" in message
    assert not Run.objects.exists()
