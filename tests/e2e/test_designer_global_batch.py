"""The designer's global batch in real headless Chromium against the real platform: it feeds the estimate (the
step runs that many accumulation steps, shown), a value the passes do not divide is refused beside the field,
and an empty field is one pass again."""

import pytest
from playwright.sync_api import expect

from .test_designer import designer, field_error, set_field, wait_for_estimate  # noqa: F401 (designer: a fixture)

pytestmark = pytest.mark.e2e

PASSES = 4


def term(estimate: dict, name: str) -> float:
    (value,) = [item["value"] for item in estimate["time"]["terms"] if item["name"] == name]
    return value


def test_the_global_batch_field_changes_the_estimate_and_refuses_what_passes_do_not_divide(designer):  # noqa: F811
    page = designer
    one = page.evaluate("window.loomDesign.estimate")
    per_pass = one["layout"]["sequences_per_pass"]
    assert one["layout"]["accumulation_steps"] == 1 and one["layout"]["global_batch"] == per_pass
    expect(page.locator("#summary-batch")).to_have_text(f"{per_pass:,} sequences, no accumulation")

    set_field(page, "data.global_batch", str(PASSES * per_pass))
    wait_for_estimate(page, f"estimate.layout.accumulation_steps === {PASSES}")
    four = page.evaluate("window.loomDesign.estimate")
    assert four["config"]["data"]["global_batch"] == PASSES * per_pass
    assert four["layout"]["tokens_per_step"] == PASSES * one["layout"]["tokens_per_step"]
    compute_one, compute_four = (term(estimate, "compute") for estimate in (one, four))
    assert compute_four == pytest.approx(PASSES * compute_one)
    assert PASSES * compute_one < four["time"]["step_s"] < PASSES * one["time"]["step_s"]
    expect(page.locator("#summary-batch")).to_have_text(
        f"{PASSES * per_pass:,} sequences: {PASSES} accumulation steps of {per_pass:,}"
    )

    set_field(page, "data.global_batch", str(PASSES * per_pass + 1))
    expect(field_error(page, "data.global_batch")).to_contain_text(
        "must be a multiple of data.micro_batch × data-parallel ranks"
    )
    expect(field_error(page, "data.global_batch")).to_contain_text(f"= {per_pass}")
    # The charts keep the last estimate that was valid.
    assert page.evaluate("window.loomDesign.estimate.layout.accumulation_steps") == PASSES

    set_field(page, "data.global_batch", "")
    wait_for_estimate(page, "estimate.layout.accumulation_steps === 1")
    expect(field_error(page, "data.global_batch")).to_be_hidden()
    assert page.evaluate("window.loomDesign.lastRequest.config.data.global_batch") is None
