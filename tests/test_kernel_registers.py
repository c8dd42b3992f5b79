"""The CPU kernels' register blocks keep their sums in registers: in the built library's machine code
(``objdump -d``), no innermost loop of vector multiply-adds in a register-blocked function reads or writes a vector
register on the stack.

A test of machine code, because the fault shows nowhere else: GCC 12 inlined ``panel_linear``'s block of 6 rows x
two panels into its walk and kept 23 of its 24 sums on the stack, a load and a store per multiply-add; every value
stayed right, and 64-row float32 products ran at half speed on a Sapphire Rapids core (docs/benchmarks.md, "Register
blocks kept in registers"). The same listing shows that ``panel_linear``'s walk keeps its fetches ahead of the
next block, which GCC can delete as silently. Skipped without objdump (binutils) or the compiled kernels.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from core_svc.models import layers
from tests.helpers import cpu_kernels_loaded

pytestmark = pytest.mark.skipif(
    shutil.which("objdump") is None or not cpu_kernels_loaded(), reason="needs objdump and the compiled CPU kernels"
)

# Functions whose sums are meant to fit the register file: panel_linear's blocks and walk (its one- to four-row
# walks are inlined into multiply_panels), and the matrix-vector blocks of 1 to 3 rows. gemv_block and
# int8_gemv_block at 4 rows are left out: 8 weight rows x 4 rows of sums are all 32 registers before x is loaded.
REGISTER_BLOCKED = re.compile(
    r"multiply_block<|multiply_few_rows<|multiply_panels\(|gemv_block<.*, [123], \d+>\(|int8_gemv_block<[123], \d+>\("
)
MULTIPLY_ADD = re.compile(r"\bv(fmadd\w*ps|pdpbusd|pmaddwd|dpbf16ps)\b.*[xyz]mm")
VECTOR_ON_STACK = re.compile(r"(\(%r[sb]p\).*[xyz]mm\d|[xyz]mm\d.*\(%r[sb]p\))")
INSTRUCTION = re.compile(r"^\s*([0-9a-f]+):\s+(\S.*)$")
BACKWARD_JUMP = re.compile(r"^j\w+\s+([0-9a-f]+) <")


def functions(library: Path) -> dict[str, list[tuple[int, str]]]:
    """Demangled function name -> its instructions as (address, text), from ``objdump -d``."""
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", str(library)], capture_output=True, text=True, check=True
    ).stdout
    result: dict[str, list[tuple[int, str]]] = {}
    for chunk in re.split(r"\n(?=[0-9a-f]+ <)", listing):
        head, _, body = chunk.partition("\n")
        if not head.endswith(">:"):
            continue
        name = head[head.index("<") + 1 : -2]
        code = [(int(m.group(1), 16), m.group(2)) for line in body.split("\n") if (m := INSTRUCTION.match(line))]
        result[name] = code
    return result


def innermost_loops(code: list[tuple[int, str]]) -> list[list[str]]:
    """The instructions of each loop (a backward jump's target to the jump) that holds no other loop."""
    index = {address: i for i, (address, _) in enumerate(code)}
    loops = []
    for i, (address, text) in enumerate(code):
        jump = BACKWARD_JUMP.match(text)
        if jump is not None and int(jump.group(1), 16) < address and int(jump.group(1), 16) in index:
            loops.append((index[int(jump.group(1), 16)], i))
    return [
        [text for _, text in code[start : end + 1]]
        for start, end in loops
        if not any(start <= s and e <= end and (s, e) != (start, end) for s, e in loops)
    ]


def stack_traffic(loop: list[str]) -> tuple[int, int]:
    """(vector multiply-adds, vector loads and stores on the stack) in one loop's instructions."""
    return sum(bool(MULTIPLY_ADD.search(t)) for t in loop), sum(bool(VECTOR_ON_STACK.search(t)) for t in loop)


def test_the_checker_sees_sums_kept_on_the_stack():
    # a loop shaped as the inlined block's before the fix, in objdump's syntax: a sum reloaded and stored per step
    spilled = [
        "vbroadcastss (%r15,%rdx,4),%zmm4",
        "vfmadd213ps 0x8(%rsp),%zmm1,%zmm11",
        "vmovaps %zmm11,0x8(%rsp)",
        "vfmadd231ps %zmm0,%zmm4,%zmm28",
        "vfmadd231ps %zmm1,%zmm4,%zmm27",
        "mov -0x10(%rsp),%rdi",  # a pointer reloaded: not a vector
        "inc %rdx",
        "jne 9870 <f+0x330>",
    ]
    assert stack_traffic(spilled) == (3, 2)
    code = [(0x100 + 4 * i, t) for i, t in enumerate([*spilled[:-1], "jne 100 <f>"])]
    assert innermost_loops(code) == [[*spilled[:-1], "jne 100 <f>"]]


def test_register_blocked_loops_keep_their_sums_in_registers():
    from kernels.attention import cpu_ops
    from splitserve.base import envs

    code = functions(cpu_ops.load(envs.kernel_dir()))
    checked = {name: body for name, body in code.items() if REGISTER_BLOCKED.search(name)}
    if layers.compiled_panel_linear() is not None:
        # the blocks are their own functions: inlined into the walk they had lost their registers
        assert any(name.startswith("void (anonymous namespace)::multiply_block<") for name in checked), sorted(checked)
    spilled: dict[str, list[tuple[int, int]]] = {}
    num_loops = 0
    for name, body in checked.items():
        for loop in innermost_loops(body):
            multiply_adds, on_stack = stack_traffic(loop)
            if multiply_adds >= 4:
                num_loops += 1
                if on_stack:
                    spilled.setdefault(name, []).append((multiply_adds, on_stack))
    assert num_loops > 0 or not checked, "no multiply-add loop found in " + ", ".join(sorted(checked))
    assert not spilled, f"(multiply-adds, vector stack accesses) per innermost loop: {spilled}"


def test_panel_walk_keeps_its_fetches_of_the_next_blocks_first_stores():
    # GCC 12 took panel_linear's helper that only fetches the next block's lines for a function without effect and
    # deleted the calls to it: the products stayed right and prefill's ran 5-18% slower. Where the CPU has PREFETCHW
    # (flag 3dnowprefetch) the walk's fetches to write are prefetchw.
    from core_svc.cpu_dtype import cpu_flags
    from kernels.attention import cpu_ops
    from splitserve.base import envs

    if layers.compiled_panel_linear() is None or "3dnowprefetch" not in cpu_flags():
        pytest.skip("needs panel_linear in the build and a CPU with PREFETCHW")
    code = functions(cpu_ops.load(envs.kernel_dir()))
    walks = [body for name, body in code.items() if "multiply_panels(" in name]
    assert walks, "no multiply_panels in the library"
    assert any(text.startswith("prefetchw ") for body in walks for _, text in body), "no prefetchw in multiply_panels"
