import pytest

from loom.runs import states


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (states.QUEUED, states.STARTING),
        (states.QUEUED, states.CANCELLED),
        (states.STARTING, states.RUNNING),
        (states.RUNNING, states.SUCCEEDED),
        (states.RUNNING, states.FAILED),
        (states.RUNNING, states.CANCELLING),
        (states.CANCELLING, states.CANCELLED),
    ],
)
def test_legal_transitions_pass(current, target):
    states.check_transition(current, target)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (states.SUCCEEDED, states.RUNNING),
        (states.CANCELLED, states.RUNNING),
        (states.FAILED, states.SUCCEEDED),
        (states.QUEUED, states.SUCCEEDED),
        (states.CANCELLING, states.RUNNING),
    ],
)
def test_illegal_transitions_name_what_is_allowed(current, target):
    with pytest.raises(states.IllegalTransition) as raised:
        states.check_transition(current, target)
    assert current in str(raised.value) and target in str(raised.value)


def test_unknown_state_is_rejected():
    with pytest.raises(ValueError, match="unknown state"):
        states.check_transition(states.RUNNING, "exploded")


def test_every_terminal_state_is_final_and_every_active_state_can_end():
    for state in states.TERMINAL:
        assert states.TRANSITIONS[state] == frozenset()
    for state in states.ACTIVE:
        assert states.TRANSITIONS[state] & states.TERMINAL
