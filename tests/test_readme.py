"""The README's Python examples run as written, top to bottom, as a user would paste them."""

import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples_for_each_interface():
    text = "\n".join(python_blocks())
    for needle in ("mha_ext.attention(", "flash_attn_interface", "attn_implementation"):
        assert needle in text


def test_readme_python_blocks_run():
    namespace = {}
    for block in python_blocks():
        if "transformers" in block and importlib.util.find_spec("transformers") is None:
            continue
        try:
            exec(compile(block, str(README), "exec"), namespace)
        except Exception as error:
            pytest.fail(f"README block failed with {error!r}:\n{block}")
