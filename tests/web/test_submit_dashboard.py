"""The Submit page in a real Chromium: every select shows its whole label (the precision select was
cut off), and a second Validate shows only what is wrong with the spec it sent: with YAML in the
editor the form is switched off (it cannot follow YAML), so no fix made there is silently left out."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from fixtures.live import LiveApi
from web_helpers import signed_in_page

pytestmark = [pytest.mark.browser, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]

# Each select's shown label against its inner width (canvas text metrics in the select's own font).
CUT_OFF = """() => [...document.querySelectorAll('form select')].filter((s) => {
  const style = getComputedStyle(s);
  const ctx = document.createElement('canvas').getContext('2d');
  ctx.font = style.font;
  const label = s.options[s.selectedIndex]?.text || '';
  const room = s.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight) - 16;
  return ctx.measureText(label).width > room;  // 16 px: the arrow
}).map((s) => s.id)"""
FIELD_ERRORS = (
    "() => [...document.querySelectorAll('.field-error')].map((e) => e.textContent).filter(Boolean)"
)


@pytest.mark.parametrize("width", [1280, 390])
def test_no_select_label_is_cut_off(
    live_api: LiveApi, browser_context: Any, page_errors: list[str], width: int
) -> None:
    page = signed_in_page(browser_context, page_errors, live_api.url, live_api.key, "/submit")
    page.set_viewport_size({"width": width, "height": 900})
    page.wait_for_selector("#f-training-precision")
    for value in ("auto", "bf16", "fp16", "fp32"):
        page.select_option("#f-training-precision", value)
        assert page.evaluate(CUT_OFF) == [], (width, value)
    assert "bf16 where the device runs it natively" in page.inner_text("#f-training-precision-hint")
    assert page_errors == []


def test_a_second_validate_shows_only_what_the_spec_sent_breaks(
    live_api: LiveApi, browser_context: Any, page_errors: list[str]
) -> None:
    live = live_api
    page = signed_in_page(browser_context, page_errors, live.url, live.key, "/submit")
    page.wait_for_selector("#spec-editor")
    spec = live.spec("twice")
    spec["model"]["num_layers"] = 0

    # JSON: the form follows the editor; a fix in the form clears its error on the next Validate.
    page.fill("#spec-editor", json.dumps(spec))
    page.dispatch_event("#spec-editor", "input")
    page.click("#validate")
    page.wait_for_selector("#f-model-num_layers-error:not(:empty)")
    page.fill("#f-model-num_layers", "1")
    page.click("#validate")
    page.wait_for_selector("#submit-result:has-text('Valid')")
    assert page.evaluate(FIELD_ERRORS) == [] and page.inner_text("#editor-errors") == ""

    # YAML: the form is off (it cannot follow YAML), and the errors are the editor's.
    page.fill("#spec-editor", yaml.safe_dump(spec))
    page.dispatch_event("#spec-editor", "input")
    assert page.is_disabled("#f-model-num_layers")
    assert "YAML" in page.inner_text("#form-note")
    page.click("#validate")
    page.wait_for_selector("#editor-errors li")
    assert "model.num_layers" in page.inner_text("#editor-errors")
    assert page.evaluate(FIELD_ERRORS) == []  # not under a form field that shows another value
    spec["model"]["num_layers"] = 1
    page.fill("#spec-editor", yaml.safe_dump(spec))
    page.dispatch_event("#spec-editor", "input")
    page.click("#validate")
    page.wait_for_selector("#submit-result:has-text('Valid')")
    assert page.inner_text("#editor-errors") == "" and page.evaluate(FIELD_ERRORS) == []
    # JSON again: the form follows it once more.
    page.fill("#spec-editor", json.dumps(spec))
    page.dispatch_event("#spec-editor", "input")
    assert not page.is_disabled("#f-model-num_layers") and page.is_hidden("#form-note")
    assert page.input_value("#f-model-num_layers") == "1"
    assert page_errors == []
