"""Measured traffic matrices against the planner's (trainer.plan.traffic): the pairs that talk, and their bytes."""


def talking(matrix: list[list[float]]) -> set[tuple[int, int]]:
    """The (source, destination) pairs that move any bytes."""
    return {
        (source, destination) for source, row in enumerate(matrix) for destination, nbytes in enumerate(row) if nbytes
    }


def assert_traffic_agrees(measured: list[list[float]], predicted: list[list[float]], slack_bytes: float = 0) -> None:
    """Every pair moves within 10 % of the planner's bytes (of the larger of the two), or within slack_bytes: what
    a step adds besides the planner's collectives (a few scalars all-reduced)."""
    for source, destination in talking(measured) | talking(predicted):
        nbytes, expected = measured[source][destination], predicted[source][destination]
        allowed = max(0.1 * max(nbytes, expected), slack_bytes)
        assert abs(expected - nbytes) <= allowed, (source, destination, nbytes, expected)
