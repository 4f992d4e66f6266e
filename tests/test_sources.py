"""csrc/sources.txt, the one list of translation units that setup.py, CMakeLists.txt and
.ci/compile_aarch64 build from: a source missing from it would silently not be built."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {"python", "cpu", "kernels", "kernels_x86", "cuda", "cuda_kernels"}


def listed_sources():
    entries = []
    for line in (ROOT / "csrc" / "sources.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            group, path = line.split()
            entries.append((group, path))
    return entries


def test_every_translation_unit_is_listed_once_in_a_known_group():
    entries = listed_sources()
    paths = [path for _, path in entries]
    assert len(paths) == len(set(paths)), (
        f"listed twice: {sorted(p for p in paths if paths.count(p) > 1)}"
    )
    assert {group for group, _ in entries} <= GROUPS
    on_disk = {
        str(p.relative_to(ROOT))
        for pattern in ("*.cpp", "*.cu")
        for p in (ROOT / "csrc").rglob(pattern)
    }
    assert set(paths) == on_disk, (
        f"unlisted: {sorted(on_disk - set(paths))}, missing: {sorted(set(paths) - on_disk)}"
    )


def test_the_portable_kernels_come_before_the_isa_builds():
    paths = [path for _, path in listed_sources()]
    assert paths.index("csrc/cpu/kernels/kernels_default.cpp") < paths.index(
        "csrc/cpu/kernels/kernels_avx2.cpp"
    )
