"""Every Python block of README.md, and the docs' quick starts, runs as written: the blocks
of one file in order, in one namespace (a later block uses what an earlier one defined),
as a reader pastes them into one session. A block fenced ```python is a complete program;
an excerpt of another package's code to change (MaxText's train step in docs/flax.md) is
fenced ```py and not run."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The documents whose Python blocks are complete programs. docs/sensitivity.md's quick
# start costs about a minute of CPU (the analysis compiles every role of its model
# quantized alone). docs/sharding.md's blocks run on whatever devices there are (the
# suite's 8 fake CPU devices here).
DOCUMENTS = [
  "README.md",
  "docs/flax.md",
  "docs/functions.md",
  "docs/sharding.md",
  pytest.param("docs/sensitivity.md", marks=pytest.mark.slow),
]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def python_blocks(document: str) -> list[str]:
  return BLOCK.findall((ROOT / document).read_text())


def test_the_readme_opens_with_a_complete_example():
  readme = (ROOT / "README.md").read_text()
  first = python_blocks("README.md")[0]
  assert readme.index("```python") < readme.index("## ")  # before any section
  for step in ("class ", "quantize_model(", "swap_report(", "def train_step", "train_step("):
    assert step in first, step


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_python_block_runs_as_written(document, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # where a block writes its files (sensitivity.png)
  blocks = python_blocks(document)
  assert blocks, document
  namespace = {"__name__": "__main__"}
  for number, block in enumerate(blocks, 1):
    code = compile(block, f"{document}, Python block {number}", "exec")
    exec(code, namespace)
