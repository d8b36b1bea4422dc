"""Which spill instructions of a kernel's SASS sit inside a loop.

ptxas reports a kernel's spill bytes, not where they are: a spill in the
prologue or the epilogue costs a few cycles once, one in the block loop costs
them every step. This reads a SASS listing (`cuobjdump -sass` or nvdisasm,
e.g. of the PTX that `tools/sm100_compile_probe.py` dumps) and reports every
local-memory access (`STL` / `LDL`: what ptxas emits for spills) that lies in
a loop, with the loop's size.

    python3 tools/sass_loops.py LISTING_OR_FOLDER...

Loops are the natural loops of the instruction graph: a branch to an address
at or before its own is a back edge, and its loop is the target plus every
instruction that reaches the branch without passing the target. So the
out-of-line retry of an mbarrier wait (placed by ptxas at the end of the
function, branching back to the wait) is a loop of a few instructions, not
everything between the wait and the end. An access is reported with the
innermost loop that holds it; loops of at most `SPIN_LOOP_SIZE` instructions
are mbarrier spins and their accesses are listed apart.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import re
import sys

# Instructions: `/*0a50*/   @!P0 BRA 0x1230 ;` (cuobjdump) or with a label
# target `BRA `(.L_x_12)` and label lines `.L_x_12:` (nvdisasm).
_INSTRUCTION = re.compile(r"/\*([0-9a-fA-F]{4,})\*/\s+([^;]*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L\w+):")
_GUARD = re.compile(r"^@!?U?P[0-6]\s+")  # @PT (always) is not a condition
_TARGET = re.compile(r"`\((\.L\w+)\)|\b(0x[0-9a-fA-F]+)\s*$")
_FUNCTION = re.compile(r"^\s*(?:\.text\.|Function\s*:\s*)(\S+?):?\s*$")
SPIN_LOOP_SIZE = 12


@dataclasses.dataclass(frozen=True)
class LoopSpill:
  function: str
  address: int  # of the STL / LDL
  instruction: str
  loop_head: int  # address of the innermost loop's first instruction
  loop_size: int  # instructions in that loop


def _functions(text: str):
  """(name, lines) per function of the listing."""
  name, lines = "", []
  for line in text.splitlines():
    match = _FUNCTION.match(line)
    if match:
      if lines:
        yield name, lines
      name, lines = match.group(1), []
    else:
      lines.append(line)
  if lines:
    yield name, lines


def _parse(lines):
  """[(address, opcode-and-operands, guarded)] and label -> address."""
  labels, instructions, pending = {}, [], []
  for line in lines:
    label = _LABEL.match(line)
    if label:
      pending.append(label.group(1))
      continue
    match = _INSTRUCTION.search(line)
    if match:
      address = int(match.group(1), 16)
      for name in pending:
        labels[name] = address
      pending = []
      text = match.group(2).strip()
      guarded = bool(_GUARD.match(text))
      instructions.append((address, _GUARD.sub("", text), guarded))
  return instructions, labels


def _successors(instructions, labels):
  """Index -> successor indices: fall-through unless an unconditional
  branch or exit; branch targets. Indirect branches (BRX, JMX) end a path."""
  index_of = {address: i for i, (address, _, _) in enumerate(instructions)}
  successors = []
  for i, (_, text, guarded) in enumerate(instructions):
    opcode = text.split()[0] if text else ""
    base = opcode.split(".")[0]
    # BRA.U UP0, target / BRA.U.ANY: conditional on a uniform predicate operand.
    conditional = guarded or bool(re.match(r"BRA\S*\s+!?U?P[0-6],", text))
    out = []
    if base == "BRA":
      match = _TARGET.search(text)
      if match:
        target = labels.get(match.group(1)) if match.group(1) else int(match.group(2), 16)
        if target in index_of:
          out.append(index_of[target])
      ends = not conditional
    else:
      ends = base in ("EXIT", "RET", "BRX", "JMX", "JMP", "KILL") and not guarded
    if not ends and i + 1 < len(instructions):
      out.append(i + 1)
    successors.append(out)
  return successors


def _loops(successors):
  """[(head index, body index set)] of every back edge's natural loop. A
  branch back to a head that does not dominate it (the entry reaches the
  branch without passing the head) closes no natural loop and is skipped."""
  predecessors = collections.defaultdict(list)
  for u, outs in enumerate(successors):
    for v in outs:
      predecessors[v].append(u)
  loops = []
  for u, outs in enumerate(successors):
    for head in outs:
      if head > u:
        continue
      body, stack = {head, u}, [u]
      while stack:
        for p in predecessors[stack.pop()]:
          if p not in body:
            body.add(p)
            stack.append(p)
      if 0 in body and head != 0:
        continue  # the entry reaches the branch around the head: not a loop of it
      loops.append((head, body))
  return loops


def loop_spills(text: str) -> list[LoopSpill]:
  """Every STL / LDL of the listing that lies in a loop."""
  found = []
  for function, lines in _functions(text):
    instructions, labels = _parse(lines)
    loops = _loops(_successors(instructions, labels))
    for i, (address, text_, _) in enumerate(instructions):
      if not re.match(r"(STL|LDL)\b", text_):
        continue
      holding = [(len(body), head) for head, body in loops if i in body]
      if holding:
        size, head = min(holding)
        found.append(LoopSpill(function, address, text_, instructions[head][0], size))
  return found


def local_accesses(text: str) -> int:
  """How many STL / LDL the listing has, in loops or not."""
  return sum(1 for line in text.splitlines()
             if (m := _INSTRUCTION.search(line)) and re.match(r"(STL|LDL)\b", _GUARD.sub("", m.group(2).strip())))


def summary(text: str) -> dict:
  """Counts of local accesses: all, in loops, in loops larger than a spin."""
  spills = loop_spills(text)
  return dict(local_accesses=local_accesses(text), in_loops=len(spills),
              in_loops_past_spins=sum(s.loop_size > SPIN_LOOP_SIZE for s in spills))


def main(paths: list[str]) -> int:
  files = []
  for path in map(pathlib.Path, paths):
    files += sorted(f for f in path.iterdir() if f.name.endswith(".sass")) if path.is_dir() else [path]
  for path in files:
    text = path.read_text(errors="replace")
    print(f"{path.name}: {summary(text)}")
    for s in loop_spills(text):
      if s.loop_size > SPIN_LOOP_SIZE:
        print(f"  {s.address:#07x} {s.instruction:40s} loop at {s.loop_head:#07x}, {s.loop_size} instructions")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
