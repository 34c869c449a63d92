"""Gradient accumulation: a step of accumulation_steps passes of micro_batch sequences trains exactly like one pass
of the whole batch, under DDP, FSDP and a pipeline schedule (whose microbatches compose with it), and the
data-parallel gradients are reduced once a step, not once a pass."""

from collections import Counter

import pytest

from .torchrun import assert_trains_like, run_trainer

pytestmark = pytest.mark.slow

STEPS = 3
SEQ_LEN = 32
GLOBAL_BATCH = 16


def run_config(micro_batch: int, **parallel) -> dict:
    """A tiny fp32 run on the demo corpus with GLOBAL_BATCH sequences a step, whatever the layout."""
    return {
        "steps": STEPS,
        "model": {"layers": 4, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq_len": SEQ_LEN},
        "parallel": parallel,
        "compute": {"precision": "fp32"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "data": {"micro_batch": micro_batch, "global_batch": GLOBAL_BATCH, "corpus_bytes": 200_000},
        # The collective recorder on, its window the whole run: how many reductions each rank issued.
        "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 60, "comm_window_steps": 100},
    }


# Each data-parallel rank runs 4 passes of 2 sequences (FSDP under a pipeline included); the pipeline alone runs
# its schedule 4 times a step, on 4 sequences in 2 microbatches each time.
ACCUMULATING = {
    "ddp2": run_config(2, dp_replicate=2),
    "fsdp2": run_config(2, dp_shard=2),
    "pp2_1f1b": run_config(4, pp=2, microbatches=2),
    "fsdp2xpp2": run_config(2, dp_shard=2, pp=2, microbatches=2),
}


# The same data-parallel layouts, each rank's share of the global batch in one pass.
UNACCUMULATED = {
    "ddp2": run_config(GLOBAL_BATCH // 2, dp_replicate=2),
    "fsdp2": run_config(GLOBAL_BATCH // 2, dp_shard=2),
    "fsdp2xpp2": run_config(GLOBAL_BATCH // 2, dp_shard=2, pp=2, microbatches=2),
}
GRADIENT_REDUCTION = {"ddp2": "all_reduce", "fsdp2": "reduce_scatter", "fsdp2xpp2": "reduce_scatter"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Runs by name, each launched once for the module."""
    runs = {}

    def launch(name: str, document: dict):
        if name not in runs:
            runs[name] = run_trainer(tmp_path_factory.mktemp(name), document)
            assert runs[name].returncode == 0, runs[name].failure_report()
        return runs[name]

    return launch


def collectives(run) -> Counter:
    """{(rank, op): how many} over the run."""
    counted = Counter()
    for rank, event in run.events("comm"):
        for op, count in event["payload"]["ops"].items():
            counted[rank, op] += count
    return counted


@pytest.fixture(scope="module")
def whole_batch(tmp_path_factory):
    """One process, the whole global batch in one pass."""
    run = run_trainer(tmp_path_factory.mktemp("whole"), run_config(GLOBAL_BATCH))
    assert run.returncode == 0, run.failure_report()
    return run


@pytest.mark.parametrize("name", list(ACCUMULATING))
def test_accumulated_passes_train_like_one_pass_of_the_global_batch(name, whole_batch, launched):
    run = launched(name, ACCUMULATING[name])
    assert len(run.loss_means()) == STEPS
    assert_trains_like(run, whole_batch)
    # Tokens count the whole global batch; each rank's tokens/s its share of it, as for the whole batch.
    for _, event in run.events("metric"):
        assert event["payload"]["tokens"] == event["step"] * GLOBAL_BATCH * SEQ_LEN


@pytest.mark.parametrize("name", list(UNACCUMULATED))
def test_data_parallel_gradients_are_reduced_once_a_step_not_once_a_pass(name, launched):
    accumulating = collectives(launched(name, ACCUMULATING[name]))
    one_pass = collectives(launched(f"{name}-one-pass", UNACCUMULATED[name]))
    reduction = GRADIENT_REDUCTION[name]
    for rank in {rank for rank, _ in one_pass}:
        assert one_pass[rank, reduction] > 0
        assert accumulating[rank, reduction] == one_pass[rank, reduction], f"rank {rank}"
