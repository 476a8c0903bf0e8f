"""Shipped chat templates are found by name, and the JSON tool-call preset renders through one."""

from pathlib import Path

from toolgym.agents.chat_template import TemplateRenderer
from toolgym.configs.assembly.parts import build_renderer
from toolgym.configs.load import SHIPPED_CHAT_TEMPLATES, chat_template_path, load_config


def test_a_shipped_template_is_found_by_name_and_a_path_stays_a_path(tmp_path):
    assert chat_template_path("qwen2.5-style") == str(SHIPPED_CHAT_TEMPLATES / "qwen2.5-style.jinja")
    assert chat_template_path("") == ""
    mine = tmp_path / "qwen2.5-style"
    mine.write_text("{{ messages[0].content }}")
    assert chat_template_path(str(mine)) == str(mine)
    assert chat_template_path("no-such-template") == "no-such-template"  # the loader says it is missing


def test_the_shop_preset_renders_through_the_shipped_template():
    config, _ = load_config("shop_tiny")
    renderer, tokenizer = build_renderer(config)
    assert isinstance(renderer, TemplateRenderer) and Path(tokenizer).name == "tokenizer.json"
