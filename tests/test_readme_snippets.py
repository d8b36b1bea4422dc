"""The README's Python runs as written: what a new user pastes works.

Every ```python block of README.md is a step of one session: the blocks run
in the order they appear, in one namespace (a later block may use what an
earlier one defined, as `q`, `k` and `v`), in a fresh Python process on the
CPU, with nothing imported or defined for them. A block that truly cannot
run on a CPU is preceded in the README by `<!-- snippet: skip: why -->`; it
is left out, and the comment must say why.

A block added to the README later is picked up here without a change.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parent.parent
README = REPO / "README.md"

# A fence opening a Python block, the block, and its closing fence; what comes
# right before it (blank lines aside) may be a skip comment.
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_SKIP = re.compile(r"<!--\s*snippet:\s*skip\b:?\s*((?:(?!-->).)*?)\s*-->\s*\Z", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Snippet:
  line: int            # the line of the README where its code starts (1-based)
  code: str
  skip_reason: str | None = None


def python_snippets(markdown: str) -> list[Snippet]:
  """The ```python blocks of a Markdown text, in order."""
  snippets = []
  for match in _BLOCK.finditer(markdown):
    before = markdown[:match.start()].rstrip()
    skip = _SKIP.search(before)
    line = markdown.count("\n", 0, match.start(1)) + 1
    snippets.append(Snippet(line, match.group(1), skip.group(1) if skip else None))
  return snippets


# Runs the snippets it reads as JSON on stdin, each compiled under the README's
# name and line numbers, so a traceback points at the README's own line.
_RUNNER = textwrap.dedent("""
    import json, sys
    namespace = {"__name__": "__main__"}
    for snippet in json.load(sys.stdin):
      print(f"[README.md:{snippet['line']}]", flush=True)
      padded = "\\n" * (snippet["line"] - 1) + snippet["code"]
      exec(compile(padded, snippet["path"], "exec"), namespace)
    print("[every snippet ran]", flush=True)
""")


def run_in_one_session(snippets: list[Snippet], cwd, path: str = str(README)):
  """Runs the snippets in order in a fresh Python process on the CPU."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  env["JAX_PLATFORMS"] = "cpu"
  # What the README asks of a machine with fewer than 8 cores before running
  # a kernel in the interpreter.
  env["NPROC"] = "32"
  # Where `~` points: a snippet that writes under it (a compilation cache)
  # writes into the test's folder.
  env["HOME"] = str(cwd)
  payload = json.dumps([{"line": s.line, "code": s.code, "path": path}
                        for s in snippets if s.skip_reason is None])
  return subprocess.run([sys.executable, "-c", _RUNNER], input=payload, cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


def test_every_python_snippet_of_the_readme_runs_in_order_on_the_cpu(tmp_path):
  snippets = python_snippets(README.read_text())
  result = run_in_one_session(snippets, cwd=tmp_path)
  assert result.returncode == 0 and "[every snippet ran]" in result.stdout, (
      "a README snippet failed (the last [README.md:N] printed is where it started):\n"
      f"{result.stdout}\n{result.stderr}")


def test_the_readme_has_snippets_and_skips_only_with_a_reason():
  snippets = python_snippets(README.read_text())
  assert len(snippets) >= 5, snippets
  for snippet in snippets:
    assert snippet.skip_reason != "", (
        f"README.md:{snippet.line}: `<!-- snippet: skip -->` must say why the block cannot "
        "run on a CPU")


_EXAMPLE = """\
Text.

```python
x = 1
```

<!-- snippet: skip: needs two GPUs -->
```python
raise RuntimeError("not run")
```

```bash
echo not python
```

```python
assert x == 1   # the first block's x
```
"""


def test_blocks_are_found_in_order_with_their_lines_and_skip_comments():
  snippets = python_snippets(_EXAMPLE)
  assert [(s.line, s.code, s.skip_reason) for s in snippets] == [
      (4, "x = 1\n", None),
      (9, 'raise RuntimeError("not run")\n', "needs two GPUs"),
      (17, "assert x == 1   # the first block's x\n", None),
  ]


def test_a_session_shares_one_namespace_and_leaves_out_skipped_blocks(tmp_path):
  result = run_in_one_session(python_snippets(_EXAMPLE), cwd=tmp_path, path="EXAMPLE.md")
  assert result.returncode == 0, result.stderr
  assert "[every snippet ran]" in result.stdout


def test_a_snippet_that_raises_fails_the_session_at_its_readme_line(tmp_path):
  failing = _EXAMPLE + "\n```python\n\nimport fa4_jax\nfa4_jax.attention(1, 2, 3)\n```\n"
  result = run_in_one_session(python_snippets(failing), cwd=tmp_path, path="EXAMPLE.md")
  assert result.returncode != 0
  assert "[every snippet ran]" not in result.stdout
  # The traceback names the Markdown file and the line of the failing call.
  line = failing.splitlines().index("fa4_jax.attention(1, 2, 3)") + 1
  assert f'File "EXAMPLE.md", line {line}' in result.stderr, result.stderr


# The front door's other promises: its links stay in the repository and
# resolve, and it cites no issue numbers a reader cannot look up.
FRONT_DOOR = ("README.md", "BENCHMARKS.md")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(markdown: str) -> set[str]:
  """The anchors GitHub gives a Markdown text's headings."""
  anchors, seen = set(), {}
  in_code = False
  for line in markdown.splitlines():
    if line.startswith("```"):
      in_code = not in_code
    if in_code or not line.startswith("#"):
      continue
    text = line.lstrip("#").strip().lower()
    slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    anchors.add(slug if count == 0 else f"{slug}-{count}")
  return anchors


def test_front_door_links_stay_in_the_repository_and_resolve():
  for name in FRONT_DOOR:
    page = REPO / name
    for target in _LINK.findall(page.read_text()):
      assert "://" not in target and not target.startswith("mailto:"), (
          f"{name} links out of the repository: {target}")
      path, _, anchor = target.partition("#")
      resolved = (page.parent / path).resolve() if path else page
      assert resolved.is_relative_to(REPO) and resolved.exists(), (
          f"{name} links to {target}, which is not in the repository")
      if anchor and resolved.suffix == ".md":
        assert anchor in heading_anchors(resolved.read_text()), (
            f"{name} links to {target}: no such heading")


def test_front_door_cites_no_issue_numbers():
  for name in FRONT_DOOR:
    for number, line in enumerate((REPO / name).read_text().splitlines(), 1):
      assert not re.search(r"(?<![\w/&])#\d+\b", line), f"{name}:{number} cites an issue: {line}"
