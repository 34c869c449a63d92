"""Hugging Face Llama ⇄ loom checkpoints: import gives transformers' logits, a run starts from the import in tp2 and
pp2 (real torchrun), its final checkpoint exports to a directory from_pretrained loads with loom's logits, and what
loom cannot run is refused naming the field.

Models are tiny and random, built and saved here: nothing is downloaded. The two training launches are shared by
the module's torchrun tests."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from trainer.checkpoint import MANIFEST, CheckpointCorrupt, CheckpointError, verify, write_manifest
from trainer.config import ModelConfig
from trainer.hf.__main__ import main as hf_cli
from trainer.hf.exporting import export_checkpoint, load_model_state, model_of
from trainer.hf.importing import ImportRefused, import_model
from trainer.hf.names import hf_name, loom_name
from trainer.model import Transformer

from .torchrun import FinishedRun, run_trainer

SEQ_LEN = 32
STEPS = 5
LR = 1e-4
TOKENS = torch.randint(0, 512, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
EXPECTED_MODEL = {
    "layers": 2,
    "dim": 64,
    "heads": 4,
    "kv_heads": 2,
    "ffn": 172,
    "vocab": 512,
    "seq_len": SEQ_LEN,
    "rope_theta": 500_000.0,
    "norm_eps": 1e-6,
}


def tiny_llama(tied: bool = False, rope: dict | None = None) -> LlamaForCausalLM:
    """A random Llama whose every weight matters: norm gains away from 1, matrices large enough for O(1) logits;
    `rope`: its rope_parameters beyond the base (Llama 3.1's scaling)."""
    config = LlamaConfig(
        **({"rope_parameters": {"rope_theta": 500_000.0, **rope}} if rope else {}),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=172,
        vocab_size=512,
        max_position_embeddings=128,
        rope_theta=500_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
            else:
                parameter.normal_(0, 0.1)
    return model.eval()


def save_llama(
    directory: Path, tied: bool = False, max_shard_size: str | None = None, rope: dict | None = None
) -> LlamaForCausalLM:
    model = tiny_llama(tied, rope)
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def hf_logits(model: LlamaForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def loom_logits(checkpoint: Path) -> torch.Tensor:
    """loom's Transformer, loaded from the checkpoint, on TOKENS."""
    section = ModelConfig.model_validate(verify(checkpoint)["model"])
    model = Transformer(section)
    model.load_state_dict(load_model_state(checkpoint, section))
    with torch.no_grad():
        return model.eval()(TOKENS)


def test_parameter_names_map_both_ways():
    assert loom_name("model.layers.3.self_attn.k_proj.weight") == "blocks.3.attention.wk.weight"
    assert loom_name("model.layers.0.mlp.gate_proj.weight") == "blocks.0.mlp.w1.weight"
    assert loom_name("model.layers.0.post_attention_layernorm.weight") == "blocks.0.mlp_norm.weight"
    assert loom_name("lm_head.weight") == "output.weight"
    assert loom_name("model.layers.0.self_attn.q_proj.bias") is None
    names = [name for name, _ in Transformer(ModelConfig(**EXPECTED_MODEL)).named_parameters()]
    assert [loom_name(hf_name(name)) for name in names] == names


@pytest.mark.parametrize(
    ("tied", "max_shard_size"), [(False, None), (False, "60KB"), (True, None)], ids=["single", "sharded", "tied"]
)
def test_an_imported_llama_gives_transformers_logits(tmp_path, tied, max_shard_size):
    hf_dir, checkpoint = tmp_path / "hf", tmp_path / "imported"
    original = save_llama(hf_dir, tied, max_shard_size)
    assert (hf_dir / "model.safetensors.index.json").is_file() == (max_shard_size is not None)

    model = import_model(hf_dir, checkpoint, seq_len=SEQ_LEN)

    assert model == ModelConfig(**EXPECTED_MODEL).model_dump()
    manifest = verify(checkpoint)
    assert (manifest["step"], manifest["world_size"], manifest["run_id"], manifest["attempt"]) == (0, 1, None, None)
    assert manifest["model"] == model
    assert manifest["source"]["kind"] == "huggingface"
    assert manifest["source"]["path"] == str(hf_dir)
    assert manifest["source"]["config"]["tie_word_embeddings"] is tied
    torch.testing.assert_close(loom_logits(checkpoint), hf_logits(original), rtol=0, atol=1e-5)


def write_config(hf_dir: Path, **changes) -> None:
    path = hf_dir / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    save_llama(directory)
    return directory


# Llama 3.1's scaling, with an original context shorter than SEQ_LEN so every band of frequencies occurs.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def test_a_llama_with_llama3_rope_scaling_imports_and_exports_with_its_logits(tmp_path):
    hf_dir, checkpoint = tmp_path / "hf", tmp_path / "imported"
    original = save_llama(hf_dir, rope=LLAMA3_ROPE)

    model = import_model(hf_dir, checkpoint, seq_len=SEQ_LEN)

    scaling = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context": 16}
    assert model["rope_scaling"] == scaling and model["rope_theta"] == 500_000.0
    torch.testing.assert_close(loom_logits(checkpoint), hf_logits(original), rtol=0, atol=1e-5)
    unscaled = Transformer(ModelConfig.model_validate({**model, "rope_scaling": None}))
    unscaled.load_state_dict(load_model_state(checkpoint, ModelConfig.model_validate(model)))
    with torch.no_grad():
        assert not torch.allclose(unscaled.eval()(TOKENS), hf_logits(original), atol=1e-3)

    exported = export_checkpoint(checkpoint, tmp_path / "exported")
    reloaded = LlamaForCausalLM.from_pretrained(exported).eval()
    assert reloaded.config.rope_parameters["rope_type"] == "llama3"
    torch.testing.assert_close(hf_logits(reloaded), hf_logits(original), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling.rope_type", "'llama3'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}}, "rope_parameters.rope_type", "'llama3'"),
        ({"attention_bias": True}, "attention_bias", "no biases"),
        ({"mlp_bias": True}, "mlp_bias", "no biases"),
        ({"hidden_act": "gelu"}, "hidden_act", "'silu'"),
        ({"head_dim": 32}, "head_dim", "= 16"),
        ({"model_type": "mistral"}, "model_type", "Llama"),
        ({"vocab_size": 100}, "vocab_size", "greater than or equal to 256"),
        ({"num_attention_heads": 3, "head_dim": None}, "num_attention_heads", "must divide dim=64"),
    ],
)
def test_what_loom_cannot_run_is_refused_naming_the_field(saved_llama, tmp_path, changes, field, words):
    hf_dir, checkpoint = tmp_path / "hf", tmp_path / "imported"
    shutil.copytree(saved_llama, hf_dir)
    write_config(hf_dir, **changes)

    with pytest.raises(ImportRefused) as refused:
        import_model(hf_dir, checkpoint)

    assert list(refused.value.errors) == [field]
    assert words in refused.value.errors[field]
    assert isinstance(refused.value, ValueError)
    assert not checkpoint.exists()


def test_a_missing_or_misshapen_tensor_is_refused_naming_it(saved_llama, tmp_path):
    hf_dir, checkpoint = tmp_path / "hf", tmp_path / "imported"
    shutil.copytree(saved_llama, hf_dir)
    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})

    with pytest.raises(ImportRefused) as refused:
        import_model(hf_dir, checkpoint)

    assert refused.value.errors == {
        "model.layers.1.mlp.down_proj.weight": "missing from the safetensors files",
        "model.norm.weight": "has shape [65]; config.json implies [64]",
    }
    assert not checkpoint.exists()


def test_the_command_line_imports_and_reports_refusals(saved_llama, tmp_path, capsys):
    assert hf_cli(["import", str(saved_llama), "--out", str(tmp_path / "imported"), "--seq-len", "64"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"]["seq_len"] == 64
    assert verify(tmp_path / "imported")["model"] == printed["model"]

    assert hf_cli(["import", str(saved_llama), "--out", str(tmp_path / "short"), "--seq-len", "4"]) == 2
    assert "--seq-len: Input should be greater than or equal to 8" in capsys.readouterr().err
    assert not (tmp_path / "short").exists()


# Training from an import: one run in tp2 and one in pp2, shared by the tests below.


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, dict]:
    directory = tmp_path_factory.mktemp("imported")
    save_llama(directory / "hf")
    return directory / "checkpoint", import_model(directory / "hf", directory / "checkpoint", seq_len=SEQ_LEN)


def run_document(checkpoint_dir: Path, init_from: Path, model: dict, **parallel) -> dict:
    return {
        "steps": STEPS,
        "model": model,
        "parallel": parallel,
        "compute": {"precision": "fp32"},
        "optimizer": {"lr": LR, "warmup_steps": 0},
        "data": {"micro_batch": 4, "corpus_bytes": 100_000},
        "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 60, "comm": False},
        "checkpoint": {"interval_steps": STEPS, "directory": str(checkpoint_dir), "init_from": str(init_from)},
    }


LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2, "microbatches": 2}}


@pytest.fixture(scope="module")
def trained(imported, tmp_path_factory) -> dict[str, tuple[FinishedRun, Path]]:
    """Each layout's run from the import, with its final checkpoint."""
    checkpoint, model = imported
    runs = {}
    for name, layout in LAYOUTS.items():
        workdir = tmp_path_factory.mktemp(name)
        run = run_trainer(workdir, run_document(workdir / "checkpoints", checkpoint, model, **layout))
        assert run.returncode == 0, run.failure_report()
        runs[name] = (run, workdir / "checkpoints" / f"step-{STEPS:06d}")
    return runs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_run_starts_from_the_imported_weights_at_step_one(imported, trained, layout):
    checkpoint, model = imported
    run, final = trained[layout]
    loaded = [event for rank, event in run.events("checkpoint") if event["payload"]["state"] == "loaded"]
    assert [event["payload"] | {"load_s": 0} for event in loaded] == [
        {"state": "loaded", "step": 0, "path": str(checkpoint), "layout": None, "world_size": 1, "load_s": 0}
        | {"initial": True}
    ]
    assert loaded[0]["step"] is None
    assert sorted(event["step"] for rank, event in run.events("metric") if rank == 0) == list(range(1, STEPS + 1))
    assert verify(final)["step"] == STEPS
    # Five AdamW steps of LR move each weight by a few LR at most; a run from fresh weights would be ~0.1 away.
    start = load_model_state(checkpoint, ModelConfig(**model))
    trained_weights = run.parameters()
    assert trained_weights.keys() == start.keys()
    for name, weight in trained_weights.items():
        moved = (weight - start[name]).abs().max().item()
        assert 0 < moved < 3 * STEPS * LR, f"{name} moved {moved}"


def test_the_first_step_sees_the_same_model_in_both_layouts(trained):
    (tp2, _), (pp2, _) = trained["tp2"], trained["pp2"]
    assert tp2.loss_means()[0] == pytest.approx(pp2.loss_means()[0], rel=1e-5)


def test_init_from_a_checkpoint_of_another_model_shape_is_refused_naming_the_fields(imported, tmp_path):
    checkpoint, model = imported
    other = model | {"dim": 32, "ffn": 86}
    run = run_trainer(tmp_path, run_document(tmp_path / "checkpoints", checkpoint, other) | {"steps": 1})

    assert run.returncode != 0
    assert f"{checkpoint.name}: saved for another model (model.dim=64, model.ffn=172); start from it" in run.output
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


# Export.


def prepared_dataset(directory: Path, trained_tokenizer: bool) -> Path:
    """A prepared dataset's manifest (FORMAT 1) and, unless byte-level, a tokenizer trained here on a few lines."""
    directory.mkdir()
    eot = "<|endoftext|>"
    if trained_tokenizer:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        lines = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine"] * 20
        tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=[eot]))
        tokenizer.save(str(directory / "tokenizer.json"))
        entry = {"kind": "trained", "file": "tokenizer.json", "vocab_size": tokenizer.get_vocab_size()}
        entry["eot_id"] = tokenizer.token_to_id(eot)
    else:
        entry = {"kind": "bytes", "file": None, "vocab_size": 257, "eot_id": 256}
    empty = {"tokens": 0, "documents": 0, "shards": []}
    manifest = {
        "format": 1,
        "dtype": "uint16",
        "tokenizer": entry | {"sha256": None, "eot_token": eot},
        "splits": {"train": empty, "validation": empty},
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_exported_checkpoint_loads_in_transformers_with_loom_logits(trained, layout, tmp_path):
    _, final = trained[layout]
    dataset = prepared_dataset(tmp_path / "dataset", trained_tokenizer=True)

    out = export_checkpoint(final, tmp_path / "hf", tokenizer_dir=dataset)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["tie_word_embeddings"], config["max_position_embeddings"], config["torch_dtype"]) == (
        False,
        SEQ_LEN,
        "float32",
    )
    assert (config["rope_theta"], config["rms_norm_eps"]) == (500_000.0, 1e-6)
    exported = LlamaForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(hf_logits(exported), loom_logits(final), rtol=0, atol=1e-5)
    assert (out / "tokenizer.json").read_bytes() == (dataset / "tokenizer.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.decode(tokenizer("the lazy fox")["input_ids"]) == "the lazy fox"


def test_a_sharded_bfloat16_export_loads_and_a_byte_level_dataset_gets_no_tokenizer(imported, trained, tmp_path):
    _, model = imported
    _, final = trained["tp2"]
    dataset = prepared_dataset(tmp_path / "bytes", trained_tokenizer=False)

    out = export_checkpoint(final, tmp_path / "hf", dataset, "bfloat16", max_shard_bytes=100_000)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    state = load_model_state(final, ModelConfig(**model))
    exported = {}
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as file:
            exported |= {name: file.get_tensor(name) for name in file.keys()}
    assert exported.keys() == {hf_name(name) for name in state}
    for name, tensor in exported.items():
        assert torch.equal(tensor, state[loom_name(name)].to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert not (out / "tokenizer.json").exists()
    assert "byte-level tokens" in (out / "README.md").read_text()
    assert LlamaForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_export_takes_the_tokenizer_of_the_dataset_the_run_trained_on(trained, tmp_path):
    _, final = trained["pp2"]
    dataset = prepared_dataset(tmp_path / "dataset", trained_tokenizer=True)
    on_dataset = tmp_path / final.name
    shutil.copytree(final, on_dataset)
    manifest = json.loads((on_dataset / MANIFEST).read_text())
    manifest["data"] = manifest["data"] | {"dataset": {"path": str(dataset)}}
    write_manifest(on_dataset, manifest)

    out = export_checkpoint(on_dataset, tmp_path / "hf")

    assert (out / "tokenizer.json").read_bytes() == (dataset / "tokenizer.json").read_bytes()
    assert (
        json.loads((out / "config.json").read_text())["eos_token_id"]
        == json.loads((dataset / "manifest.json").read_text())["tokenizer"]["eot_id"]
    )


def test_export_refuses_a_corrupt_checkpoint_naming_the_file(trained, tmp_path, capsys):
    _, final = trained["pp2"]
    damaged = tmp_path / final.name
    shutil.copytree(final, damaged)
    shard = sorted(damaged.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    with pytest.raises(CheckpointCorrupt, match=f"{damaged.name}/{shard.name}: sha256 mismatch"):
        export_checkpoint(damaged, tmp_path / "hf")
    assert hf_cli(["export", str(damaged), "--out", str(tmp_path / "hf")]) == 2
    assert f"{damaged.name}/{shard.name}: sha256 mismatch" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    assert (damaged / MANIFEST).is_file()


def test_export_refuses_a_model_hugging_faces_llama_cannot_hold_saying_what_differs(tmp_path):
    manifest = {"model": {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "mlp": "gelu"}}
    with pytest.raises(CheckpointError, match="gelu feed-forward blocks; the export writes Hugging Face's Llama"):
        model_of(manifest, tmp_path / "step-00000004")
    assert model_of({**manifest, "model": {**manifest["model"], "mlp": "swiglu"}}, tmp_path).mlp == "swiglu"
    parallel = {**manifest, "model": {**manifest["model"], "mlp": "swiglu", "parallel_blocks": True}}
    with pytest.raises(CheckpointError, match=r"parallel attention and MLP blocks \(model.parallel_blocks\)"):
        model_of(parallel, tmp_path / "step-00000004")
