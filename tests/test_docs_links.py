"""Every relative link of README.md, docs/*.md and examples/train/README.md points at a file
that exists, and every #anchor at a heading of its target, as GitHub renders them."""

import collections
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "examples" / "train" / "README.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
  """GitHub's anchor of a heading: lowercase, markup and punctuation but '-' and '_' dropped,
  spaces to '-'."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
  text = text.replace("`", "").strip().lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
  """The anchors of a page's headings (outside code blocks; repeats get -1, -2, ...)."""
  seen: collections.Counter[str] = collections.Counter()
  out, fenced = set(), False
  for line in page.read_text().splitlines():
    if FENCE.match(line):
      fenced = not fenced
    elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
      base = slug(m.group(1))
      out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
      seen[base] += 1
  return out


def links(page: pathlib.Path):
  """(line number, target) of every link and image outside code blocks and code spans; a link
  whose text wraps onto the next lines is read whole (its first line's number)."""
  return links_in(page.read_text())


def links_in(text: str):
  fenced, pending, start = False, "", 0
  for number, line in enumerate(text.splitlines(), 1):
    if FENCE.match(line):
      fenced, pending = not fenced, ""
      continue
    if fenced:
      continue
    if not line.strip():  # a paragraph ends: an unclosed bracket there is not a link
      pending = ""
      continue
    if not pending:
      start = number
    joined = (pending + " " + line) if pending else line
    text_only = re.sub(r"`[^`]*`", "", joined)
    if text_only.count("[") > text_only.count("]"):  # a link's text goes on below
      pending = joined
      continue
    pending = ""
    for m in LINK.finditer(text_only):
      yield start, m.group(1) or m.group(2)


def test_links_whose_text_wraps_are_read():
  text = "see [kernels.md, \"fused\ncalibration\"](kernels.md#x) and [a](b.md)\n\n[c\n\n[d](e.md)\n"
  assert list(links_in(text)) == [(1, "kernels.md#x"), (1, "b.md"), (6, "e.md")]


def test_the_slug_follows_github():
  assert slug("Where a one-kernel custom call's floor goes (one GPU, measured)") == (
      "where-a-one-kernel-custom-calls-floor-goes-one-gpu-measured")
  assert slug("`all_reduce_rms_norm`: the norm in the one-shot's epilogue") == (
      "all_reduce_rms_norm-the-norm-in-the-one-shots-epilogue")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
  broken = []
  for number, target in links(page):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
      continue
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
      broken.append(f"{page.name}:{number}: {target} (no such file)")
    elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
      broken.append(f"{page.name}:{number}: {target} (no heading with that anchor)")
  assert not broken, "\n".join(broken)
