import pytest
import torch

from trainer.config import ModelConfig
from trainer.metrics import memory, mfu, model_flops_per_token, own_work, peak_flops


def test_flops_per_token_follows_the_stated_convention():
    model = ModelConfig(layers=32, dim=4096, heads=32, kv_heads=8, ffn=14336, seq_len=8192)
    non_embedding = 7_000_000_000
    assert model_flops_per_token(model, non_embedding) == 6 * 7e9 + 12 * 32 * 4096 * 8192


def test_mfu_is_achieved_flops_per_rank_over_peak():
    # 1e12 FLOPs a token, 4,096 tokens in 2 s over 4 ranks: 5.12e14 FLOP/s a rank, half of a 1.024e15 peak.
    assert mfu(1e12, 4096, 2.0, 4, 1.024e15) == pytest.approx(0.5)
    assert mfu(1e12, 4096, 2.0, 4, None) is None


def test_cpus_have_no_peak_and_report_resident_memory():
    assert peak_flops(torch.device("cpu")) is None
    before = memory(torch.device("cpu"))
    ballast = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)  # 64 MiB, touched
    after = memory(torch.device("cpu"))
    assert after["memory_rss"] - before["memory_rss"] >= 60 * 1024 * 1024
    assert after["memory_peak_rss"] >= after["memory_rss"]
    del ballast


def test_own_work_is_the_step_outside_its_collectives_and_never_negative():
    assert own_work(0.5, 0.2) == pytest.approx({"comm_s": 0.2, "compute_s": 0.3})
    # Collectives that overlap each other (or the rank's work) can sum past the step.
    assert own_work(0.5, 0.7) == {"comm_s": 0.7, "compute_s": 0.0}
