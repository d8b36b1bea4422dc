"""tools/sass_loops.py finds the spill accesses that sit inside loops of a
SASS listing (how the sm100 compile probe tells a spill in the block loop
from one in the prologue)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import sass_loops  # noqa: E402


def _listing():
  """cuobjdump's form: a prologue spill; a block loop (0x20-0x100, 16
  instructions with the wait's retry) holding a reload and an mbarrier wait
  whose retry ptxas placed after the exit (0x130-0x140, branching back to the
  wait); an epilogue reload."""
  lines = ["\t\tFunction : attention_kernel",
           "/*0000*/ LDC R1, c[0x0][0x37c] ;",
           "/*0010*/ STL [R1+0x4], R12 ;",
           "/*0020*/ UTCHMMA tmem[UR4], gdesc[UR6], tmem[UR8], UR10, UPT ;",
           "/*0030*/ SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;",
           "/*0040*/ @!P0 BRA 0x130 ;",
           "/*0050*/ LDL R12, [R1+0x4] ;"]
  lines += [f"/*{a:04x}*/ FFMA R4, R5, R6, R4 ;" for a in range(0x60, 0x100, 0x10)]
  lines += ["/*0100*/ BRA.U UP0, 0x20 ;",
            "/*0110*/ LDL R13, [R1+0x8] ;",
            "/*0120*/ EXIT ;",
            "/*0130*/ NANOSLEEP 0x20 ;",
            "/*0140*/ BRA 0x30 ;"]
  return "\n".join("        " + line for line in lines) + "\n"


LISTING = _listing()


def test_only_the_access_in_the_block_loop_is_reported_with_that_loop():
  spills = sass_loops.loop_spills(LISTING)
  assert [(s.address, s.instruction.split()[0], s.loop_head) for s in spills] == [(0x50, "LDL", 0x20)]
  # The block loop: 0x20-0x100 and the retry 0x130-0x140 that returns into it.
  assert spills[0].loop_size == 17
  assert spills[0].function == "attention_kernel"
  assert sass_loops.local_accesses(LISTING) == 3


def test_a_wait_retry_at_the_end_is_a_small_loop_not_the_code_before_it():
  # Without the block loop's back edge only the wait's retry loop remains,
  # and the reload between the wait and the end is in no loop.
  listing = LISTING.replace("BRA.U UP0, 0x20", "NOP")
  assert sass_loops.loop_spills(listing) == []


def test_a_spill_in_a_spin_loop_is_counted_apart():
  listing = LISTING.replace("NANOSLEEP 0x20", "STL [R1], R5")
  summary = sass_loops.summary(listing)
  assert summary == dict(local_accesses=4, in_loops=2, in_loops_past_spins=1)


def test_nvdisasm_labels_are_read_as_branch_targets():
  listing = (LISTING.replace("BRA.U UP0, 0x20", "BRA.U UP0, `(.L_x_1)")
             .replace("        /*0020*/", ".L_x_1:\n        /*0020*/"))
  assert [s.loop_head for s in sass_loops.loop_spills(listing)] == [0x20]
