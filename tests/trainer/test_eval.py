"""Validation loss: when it is evaluated, on which text, and that every layout reports the single process's value
(the token-dataset matrix in test_parallel_equivalence.py covers DDP, FSDP, TP, 1F1B and CP; here the multi-stage
pipeline schedules, whose forward-only runs PyTorch does not support by itself, on the demo corpus)."""

import pytest
import torch

from trainer.config import ConfigError, parse_config
from trainer.data.demo import WindowSampler, check_validation, load_corpus, load_validation
from trainer.train import evaluation_due

from .torchrun import run_trainer

STEPS = 5


def demo_config(**sections) -> dict:
    document = {
        "steps": STEPS,
        "model": {"layers": 4, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq_len": 32},
        "compute": {"precision": "fp32"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "data": {"micro_batch": 4, "corpus_bytes": 100_000},
        "eval": {"interval_steps": 2, "batches": 3},
        "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 60, "comm": False},
    }
    for section, values in sections.items():
        document[section] = {**document.get(section, {}), **values}
    return document


def test_evaluation_runs_every_interval_and_after_the_last_step():
    config = parse_config({"steps": 10, "eval": {"interval_steps": 3}})
    assert [step for step in range(1, 11) if evaluation_due(step, config)] == [3, 6, 9, 10]
    config = parse_config({"steps": 10, "eval": {"interval_steps": 5}})
    assert [step for step in range(1, 11) if evaluation_due(step, config)] == [5, 10]
    never = parse_config({"steps": 10})
    assert not any(evaluation_due(step, never) for step in range(1, 11))


def test_the_demo_validation_text_follows_the_training_bytes_and_training_is_unchanged():
    config = parse_config(demo_config())
    validation = load_validation(config)
    following = load_corpus(100_000 + validation.numel())[100_000:]
    assert validation.numel() == 3 * 4 * 32 + 1 and torch.equal(validation, following)
    with_eval = WindowSampler.from_config(config)
    without = WindowSampler.from_config(parse_config(demo_config(eval={"interval_steps": 0})))
    assert torch.equal(with_eval.tokens, without.tokens)
    for step in (1, 2, 9):
        assert torch.equal(with_eval.batch(step)[0], without.batch(step)[0])
    batches = with_eval.validation_batches(3, 0, 1)
    assert [tuple(inputs.shape) for inputs, _ in batches] == [(4, 32)] * 3
    assert torch.equal(batches[1][0][0], validation[4 * 32 : 5 * 32].long())


def test_accumulation_keeps_the_demo_global_batch_and_slices_it_per_rank():
    whole = WindowSampler(load_corpus(50_000), seq_len=32, micro_batch=8, seed=0).batch(3)[0]
    accumulating = WindowSampler(load_corpus(50_000), seq_len=32, micro_batch=2, seed=0, accumulation_steps=2)
    assert torch.equal(torch.cat([accumulating.batch(3, rank, 2)[0] for rank in (0, 1)]), whole)


def test_evaluating_without_validation_text_is_refused_naming_the_field():
    config = parse_config(demo_config(data={"corpus_bytes": 200_000_000}))
    with pytest.raises(ConfigError) as refused:
        check_validation(config)
    assert "data.corpus_bytes" in refused.value.errors["eval.interval_steps"]
    check_validation(parse_config(demo_config(data={"corpus_bytes": 200_000_000}, eval={"interval_steps": 0})))


PIPELINES = {
    "pp2_zbvzerobubble": {"pp": 2, "pp_schedule": "ZBVZeroBubble", "stages_per_rank": 2, "microbatches": 2},
    "fsdp2xpp2_interleaved1f1b": {
        "pp": 2,
        "dp_shard": 2,
        "pp_schedule": "Interleaved1F1B",
        "stages_per_rank": 2,
        "microbatches": 2,
    },
}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    run = run_trainer(tmp_path_factory.mktemp("single"), demo_config(data={"micro_batch": 4}))
    assert run.returncode == 0, run.failure_report()
    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PIPELINES))
def test_a_pipeline_reports_the_single_process_validation_loss_at_the_same_steps(name, single_process, tmp_path):
    parallel = PIPELINES[name]
    micro_batch = 4 // parallel.get("dp_shard", 1)
    run = run_trainer(tmp_path, demo_config(parallel=parallel, data={"micro_batch": micro_batch}))
    assert run.returncode == 0, run.failure_report()
    (want,) = single_process.eval_losses().values()
    assert sorted(want) == [2, 4, 5]
    evaluated = run.eval_losses()
    assert sorted(evaluated) == list(range(2 * parallel.get("dp_shard", 1)))
    for rank, got in evaluated.items():
        assert sorted(got) == [2, 4, 5]
        for step, value in got.items():
            assert abs(value - want[step]) <= 1e-5 * want[step], f"rank {rank} step {step}"
    # Evaluating changes no parameter: training goes on exactly as the single process's.
    for want_loss, got_loss in zip(single_process.loss_means(), run.loss_means(), strict=True):
        assert abs(got_loss - want_loss) <= 1e-5 * want_loss
