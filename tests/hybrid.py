"""The pp 2 × dp_shard 2 × tp 2 layout the traffic tests run for real (trainer, planner and page), and
where its ranks sit in the mesh."""

WORLD = 8


def hybrid_config(steps: int, comm_window_steps: int, **sections: dict) -> dict:
    """The run: seq_len 64, not the equivalence tests' 32, because TP moves activations (∝ tokens) and
    FSDP moves parameters (fixed), and at 32 tokens this tiny model's FSDP traffic outweighs its TP's."""
    return {
        "steps": steps,
        "model": {"layers": 4, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq_len": 64},
        "parallel": {"pp": 2, "dp_shard": 2, "tp": 2, "microbatches": 2},
        "compute": {"precision": "fp32"},
        "data": {"micro_batch": 4, "corpus_bytes": 200_000},
        "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 60, "comm_window_steps": comm_window_steps},
        **sections,
    }


def coordinates(rank: int) -> tuple[int, int, int]:
    """(pp, dp, tp) of a rank, tp innermost."""
    return rank // 4, rank // 2 % 2, rank % 2


def kind_of_pair(source: int, destination: int) -> str | None:
    """The mesh dim two ranks share a group on, or None when they differ in more than one coordinate."""
    pairs = zip(("pp", "dp", "tp"), coordinates(source), coordinates(destination), strict=True)
    differing = [dim for dim, a, b in pairs if a != b]
    return differing[0] if len(differing) == 1 else None
