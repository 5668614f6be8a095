"""The kernel build driver (kernels/build.py): a first use says what it builds before the compiler
runs, and builds the one library this CPU runs, not the AVX2 one as well to ask the CPU."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from quickdraft import kernels
from quickdraft.kernels import build

built = kernels.kernel_info()


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], str]]:
    """An empty kernel cache and no library loaded yet; the compiler replaced by a copy of the
    library this process already runs. Yields the compiles asked for: (flags, what stderr held then)."""
    if built.path is None:
        pytest.skip(f"no kernel can be built here: {built.status}")
    monkeypatch.setattr(build, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(build, "_libs", {})
    monkeypatch.setattr(build, "_active", None)
    monkeypatch.delenv(build.FORCE_ENV, raising=False)
    calls: list[tuple[list[str], str]] = []
    return calls


def test_a_first_build_says_what_it_builds_first_and_builds_one_library(
        fresh_cache: list, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_compile(compiler: str, flags: list[str], target: Path) -> None:
        fresh_cache.append((flags, capsys.readouterr().err))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(built.path, target)

    monkeypatch.setattr(build, "_compile", fake_compile)
    info = build.prepare()
    isa = "avx512vnni" if build.cpu_has_vnni() else "avx2"
    assert info.isa == isa
    assert [flags for flags, _ in fresh_cache] == [build.FLAGS[isa]]  # once, for this CPU's instruction set
    said = fresh_cache[0][1]
    assert f"building the CPU kernels for {isa} (first use only, {build.BUILD_TIME})" in said
    assert len(list(Path(build.cache_dir()).glob("*.so"))) == 1
    # built: a second process finds it in the cache and says nothing
    monkeypatch.setattr(build, "_libs", {})
    monkeypatch.setattr(build, "_active", None)
    assert build.prepare().isa == isa and len(fresh_cache) == 1
    assert "building" not in capsys.readouterr().err


def test_a_failed_vnni_build_falls_back_to_avx2_and_says_why(
        fresh_cache: list, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail_vnni(compiler: str, flags: list[str], target: Path) -> str | None:
        fresh_cache.append((flags, capsys.readouterr().err))
        if "-DQD_VNNI" in flags:
            return "build failed (an old compiler)"
        shutil.copy(built.path, target)
        return None

    monkeypatch.setattr(build, "_compile", fail_vnni)
    monkeypatch.setattr(build, "cpu_has_vnni", lambda: True)
    info = build.prepare()
    assert info.isa == "avx2" and "avx512vnni unavailable: build failed (an old compiler)" in info.status
    assert [flags for flags, _ in fresh_cache] == [build.FLAGS["avx512vnni"], build.FLAGS["avx2"]]


@pytest.mark.parametrize("flags, expected", [
    ("fpu avx2 fma avx512f avx512bw avx512vl avx512_vnni", True),
    ("fpu avx2 fma avx512f avx512bw avx512vl", False),   # AVX512 without VNNI (Skylake-X)
    ("fpu avx2 fma avx_vnni", False),                    # AVX-VNNI (Alder Lake) is not AVX512-VNNI
])
def test_cpu_has_vnni_reads_the_kernels_flags(tmp_path: Path, flags: str, expected: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert build.cpu_has_vnni(cpuinfo) is expected
    assert build.cpu_has_vnni(tmp_path / "missing") is None


@pytest.mark.slow
def test_cpu_has_vnni_agrees_with_the_cpu() -> None:
    """/proc/cpuinfo's answer is the compiler's own (__builtin_cpu_supports in the AVX2 build, which
    this builds: slow)."""
    if built.path is None or build.cpu_has_vnni() is None:
        pytest.skip("no kernel or no /proc/cpuinfo here")
    assert build.cpu_has_vnni() == bool(build.library("avx2").qd_cpu_has_vnni())
