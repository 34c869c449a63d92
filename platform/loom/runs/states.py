"""The attempt state machine. A run's state is its latest attempt's state."""

QUEUED = "queued"
STARTING = "starting"
RUNNING = "running"
CANCELLING = "cancelling"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"

TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
ACTIVE = frozenset({QUEUED, STARTING, RUNNING, CANCELLING})

TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({STARTING, CANCELLED, FAILED}),
    STARTING: frozenset({RUNNING, CANCELLING, FAILED, CANCELLED}),
    RUNNING: frozenset({CANCELLING, SUCCEEDED, FAILED, CANCELLED}),
    CANCELLING: frozenset({CANCELLED, SUCCEEDED, FAILED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}

CHOICES = [(state, state) for state in TRANSITIONS]


class IllegalTransition(ValueError):
    def __init__(self, current: str, target: str):
        allowed = sorted(TRANSITIONS[current]) or ["none: it is final"]
        super().__init__(f"cannot go from {current} to {target}; allowed: {', '.join(allowed)}")
        self.current = current
        self.target = target


def check_transition(current: str, target: str) -> None:
    if target not in TRANSITIONS:
        raise ValueError(f"unknown state {target!r}; known: {', '.join(TRANSITIONS)}")
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(current, target)
