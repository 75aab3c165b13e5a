"""docs/run_blocks.py: which blocks it finds, which it skips, and how a failing block is named."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("run_blocks", ROOT / "docs" / "run_blocks.py")
run_blocks = importlib.util.module_from_spec(_spec)
sys.modules["run_blocks"] = run_blocks  # dataclasses look their module up while the class is built
_spec.loader.exec_module(run_blocks)

PAGE = """# A page

```bash
echo one
```

<!-- skip-ci: needs a GPU -->

```bash
nvidia-smi
```

````markdown
```bash
echo inside a markdown block: not a block of its own
```
````

```python
print("not bash")
```

- a list item
    ```bash
    echo indented
    ```
"""


def test_blocks_lines_markers_and_nesting(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE, encoding="utf-8")
    blocks = run_blocks.bash_blocks(page)
    assert [(b.line, b.skip) for b in blocks] == [(3, None), (9, "needs a GPU"), (24, None)]
    assert blocks[0].code == "echo one\n"
    assert blocks[2].code == "echo indented\n"


@pytest.mark.parametrize(
    "text, message",
    [
        ("<!-- skip-ci: -->\n```bash\ntrue\n```\n", "needs a reason"),
        ("<!-- skip-ci: hub -->\n\nsome prose\n\n```bash\ntrue\n```\n", "no bash block after it"),
        ("<!-- skip-ci: hub -->\n```text\nout\n```\n", "not bash"),
        ("text\n<!-- skip-ci: hub -->\n", "no bash block after it"),
        ("```bash\ntrue\n", "never closed"),
    ],
)
def test_marker_mistakes_are_errors(tmp_path, text, message):
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    with pytest.raises(run_blocks.MarkerError, match=message):
        run_blocks.bash_blocks(page)


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failing_block_is_named_and_stops_its_file_only(tmp_path, jobs):
    first, second = tmp_path / "first.md", tmp_path / "second.md"
    marker = tmp_path / "ran"
    first.write_text(
        f"```bash\ntrue\n```\n\n```bash\nfalse | cat\n```\n\n```bash\ntouch {marker}-first\n```\n",
        encoding="utf-8",
    )
    second.write_text(f"```bash\ntouch {marker}-second\n```\n", encoding="utf-8")
    said: list[str] = []
    passed, failures = run_blocks.run_files([first, second], say=said.append, jobs=jobs)
    assert passed == 2
    assert failures == [f"{first}:5: the bash block exited with status 1"]  # pipefail: `false | cat` fails
    assert not Path(f"{marker}-first").exists() and Path(f"{marker}-second").exists()


def test_blocks_run_with_the_venv_and_no_hub():
    env = run_blocks.block_env()
    assert env["PATH"].split(":")[0] == str(ROOT / ".venv" / "bin")
    assert env["HF_HUB_OFFLINE"] == "1"


def test_files_run_side_by_side_share_the_cores(monkeypatch):
    for name in run_blocks.THREAD_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(run_blocks.os, "cpu_count", lambda: 4)
    assert "OMP_NUM_THREADS" not in run_blocks.block_env(1)
    assert run_blocks.block_env(2)["OMP_NUM_THREADS"] == "2"
    assert run_blocks.block_env(8)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the caller's choice stands
    assert run_blocks.block_env(2)["OMP_NUM_THREADS"] == "3"


def test_each_page_writes_its_own_folders_of_docs_out():
    """Files run side by side (--jobs), so no two pages may write the same docs_out/ entry."""
    owner: dict[str, str] = {}
    for path in run_blocks.default_files():
        code = "".join(b.code for b in run_blocks.bash_blocks(path) if not b.skip)
        for entry in set(re.findall(r"docs_out/([\w.-]+)", code)):
            assert owner.setdefault(entry, path.name) == path.name, (
                f"docs_out/{entry} is written by {owner[entry]} and {path.name}"
            )


def test_every_page_s_markers_parse():
    for path in run_blocks.default_files():
        run_blocks.bash_blocks(path)
