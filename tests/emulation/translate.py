"""Turns a CUDA kernel source into host C++ for the emulator in emu.h (see its header)."""

import re

# kernel<<<grid, block, shared, stream>>>(args);  (the kernel may carry template arguments;
# clang-format may break the line before the <<<). The config and arguments hold no ';', so
# a comment that shows a launch never matches.
_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;]*>)?)\s*<<<([^;]*?)>>>\(([^;]*?)\);")
_DYNAMIC_SHARED = re.compile(r"extern __shared__ __align__\(\d+\) unsigned char (\w+)\[\];")
_MMA = re.compile(
    r'asm volatile\(\s*"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)\..*?\);', re.DOTALL
)
_MMA_TYPES = {"f16": "__half", "bf16": "__nv_bfloat16"}


def translate(source: str) -> str:
    text = _DYNAMIC_SHARED.sub(r"unsigned char* \1 = ::emu::dynamic_shared();", source)
    text = text.replace(
        "__shared__ ", "static "
    )  # one instance per kernel: blocks run one at a time
    text = _MMA.sub(lambda m: f"::emu::mma_16x8x16<{_MMA_TYPES[m.group(1)]}>(c, a, b);", text)
    text = _LAUNCH.sub(r"::emu::launch(\1, ::emu::Config{\2}, \3);", text)
    code = "\n".join(
        line.split("//")[0] for line in text.splitlines()
    )  # comments may show CUDA syntax
    if "<<<" in code or "asm " in code or "__shared__" in code:
        raise ValueError("translate.py: a CUDA construct was left untranslated")
    return '#include "emu.h"\n' + text
