"""The configuration page (docs/configuration.md): its table is deploy.config_doc's output, every value has a meaning."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy import config_doc
from deploy.render import load_values


def test_every_value_and_placeholder_has_a_meaning() -> None:
    assert config_doc.problems(load_values(config_doc.VALUES), config_doc.uses()) == []


def test_the_page_is_up_to_date() -> None:
    """Out of date: ``python -m deploy.config_doc --write``."""
    page = config_doc.PAGE.read_text(encoding="utf-8")
    generated = config_doc.table(load_values(config_doc.VALUES), config_doc.uses())
    assert config_doc.render_page(page, generated) == page
    assert config_doc.main([]) == 0


def test_what_a_template_fills_and_what_lacks_a_meaning(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.pbtxt.in").write_text(
        '# ${COMMENTED} is not a use\ninstance_group [ { count: ${MAX_BATCH}, kind: KIND_CPU } ]\n'
        'parameters { key: "x" value: { string_value: "${NEW_VALUE}" } }\n', encoding="utf-8")
    used = config_doc.uses(tmp_path)
    assert used == {"MAX_BATCH": ["`m`: instances"], "NEW_VALUE": ["`m`: `x`"]}
    values = {name: "" for name in config_doc.MEANINGS if name not in config_doc.MAKEFILE_VALUES}
    assert config_doc.problems({**values, "ALSO_NEW": "1"}, used) == [
        "ALSO_NEW: no meaning in deploy.config_doc.MEANINGS", "NEW_VALUE: no meaning in deploy.config_doc.MEANINGS"]
    assert config_doc.problems({k: v for k, v in values.items() if k != "DEVICE"}, {}) == [
        "DEVICE: a meaning, but no such value"]


@pytest.mark.parametrize("page", ["no markers", f"{config_doc.END}\n{config_doc.BEGIN}\n"])
def test_a_page_without_its_block_is_refused(page: str) -> None:
    with pytest.raises(ValueError, match="no '<!-- BEGIN GENERATED: deploy/config_doc.py -->' ... "):
        config_doc.render_page(page, "| table |")


def test_the_block_is_replaced_and_the_rest_kept() -> None:
    page = f"# Configuration\n\nprose\n\n{config_doc.BEGIN}\n\nold\n\n{config_doc.END}\n"
    assert config_doc.render_page(page, "| new |") == (
        f"# Configuration\n\nprose\n\n{config_doc.BEGIN}\n\n| new |\n\n{config_doc.END}\n")
