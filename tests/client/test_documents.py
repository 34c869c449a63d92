"""Config files (YAML and JSON) and `--set path=value` changes, as `loom run submit` reads them."""

import json

import pytest

from loom_client.documents import DocumentError, load_document, parse_override, parse_overrides, with_overrides


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("parallel.tp=2", ("parallel.tp", 2)),
        ("optimizer.lr=0.001", ("optimizer.lr", 0.001)),
        # YAML 1.1 reads 1e-4 as text; a learning rate written so is still a number.
        ("optimizer.lr=1e-4", ("optimizer.lr", 1e-4)),
        ("compute.compile=true", ("compute.compile", True)),
        ("checkpoint.resume=null", ("checkpoint.resume", None)),
        ("compute.precision=bf16", ("compute.precision", "bf16")),
        ("name='2'", ("name", "2")),
        ("faults.at_steps=[3, 5]", ("faults.at_steps", [3, 5])),
        (" steps = 40", ("steps", 40)),
        ("parallel.pp_schedule=nan", ("parallel.pp_schedule", "nan")),
    ],
)
def test_a_set_value_is_read_as_yaml(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("parallel.tp", "write it as PATH=VALUE"),
        ("=2", "not a dotted path"),
        ("parallel..tp=2", "not a dotted path"),
        (".tp=2", "not a dotted path"),
        ("parallel.=2", "not a dotted path"),
        ("parallel.tp=[1, 2", "the value is not YAML"),
    ],
)
def test_a_malformed_set_says_what_is_wrong(text, complaint):
    with pytest.raises(DocumentError, match=complaint) as refused:
        parse_override(text)
    assert repr(text) in str(refused.value)


def test_changes_land_on_nested_paths_and_leave_the_original_alone():
    document = {"steps": 20, "parallel": {"dp_replicate": 2}}
    changed = with_overrides(
        document, parse_overrides(["parallel.dp_replicate=1", "parallel.dp_shard=2", "model.moe.gate=sigmoid"])
    )
    assert changed == {
        "steps": 20,
        "parallel": {"dp_replicate": 1, "dp_shard": 2},
        "model": {"moe": {"gate": "sigmoid"}},
    }
    assert document == {"steps": 20, "parallel": {"dp_replicate": 2}}


def test_a_path_through_a_value_that_is_no_section_is_refused():
    with pytest.raises(DocumentError, match="steps.every: steps is 20, not a section"):
        with_overrides({"steps": 20}, {"steps.every": 2})


def test_yaml_and_json_files_give_the_same_document(tmp_path):
    document = {"steps": 12, "model": {"layers": 2, "dim": 64}, "optimizer": {"lr": 0.003}}
    (tmp_path / "run.json").write_text(json.dumps(document))
    (tmp_path / "run.yaml").write_text("steps: 12\nmodel:\n  layers: 2\n  dim: 64\noptimizer:\n  lr: 0.003\n")
    assert load_document(tmp_path / "run.json") == load_document(tmp_path / "run.yaml") == document


@pytest.mark.parametrize(
    ("name", "content", "complaint"),
    [
        ("broken.yaml", "model: {layers: 2\n", "invalid YAML"),
        ("broken.json", '{"steps": 12,}', "invalid JSON"),
        ("list.yaml", "- 1\n- 2\n", "must hold a run config .* not a list"),
        ("empty.yaml", "", "not nothing"),
        ("dated.yaml", "started: 2024-05-01\n", "a value JSON cannot carry"),
    ],
)
def test_a_bad_file_is_named_with_its_problem(tmp_path, name, content, complaint):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DocumentError, match=complaint) as refused:
        load_document(path)
    assert str(refused.value).startswith(f"{path}: ")


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(DocumentError, match="cannot read it: No such file or directory") as refused:
        load_document(tmp_path / "absent.yaml")
    assert str(tmp_path / "absent.yaml") in str(refused.value)
