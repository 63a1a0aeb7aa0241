"""The built-in GPU check's reading of nvidia-smi (agents/gpucheck.py): pure, on the CSV lines
nvidia-smi prints for ``--query-gpu=... --format=csv,noheader,nounits``."""

from __future__ import annotations

import os
import stat

from agents import gpucheck


def rows(text):
    return [[c.strip() for c in line.split(",")] for line in text.strip().splitlines()]


HEALTHY = rows("""
0, 00000000:18:00.0, 0, No
1, 00000000:2A:00.0, 0, No
""")
# A100/H100: no page retirement (row remapping instead), so nvidia-smi says [N/A].
AMPERE = rows("""
0, 00000000:18:00.0, 0, [N/A]
1, 00000000:2A:00.0, 0, [N/A]
""")


def test_healthy_gpus_pass():
    assert gpucheck.parse(HEALTHY, [], expected=2) == []
    assert gpucheck.parse(AMPERE, rows("0, No, No\n1, No, No"), expected=None) == []


def test_a_gpu_fallen_off_the_bus_shows_as_a_missing_count():
    assert gpucheck.parse(HEALTHY[:1], [], expected=2) == ["nvidia-smi sees 1 GPU(s), 2 expected"]
    assert gpucheck.parse([], [], expected=None) == ["nvidia-smi sees no GPU"]


def test_uncorrectable_ecc_and_pending_retirement_name_the_gpu():
    bad = rows("""
0, 00000000:18:00.0, 0, No
1, 00000000:2A:00.0, 3, Yes
""")
    assert gpucheck.parse(bad, [], expected=2) == [
        "GPU 1 (00000000:2A:00.0): 3 uncorrectable ECC error(s) since the driver loaded",
        "GPU 1 (00000000:2A:00.0): retired pages pending (a reset is due)"]


def test_row_remapping_pending_or_failed_is_unhealthy():
    assert gpucheck.parse(AMPERE, rows("0, Yes, No\n1, No, Yes"), expected=2) == [
        "GPU 0: remapped rows pending (a reset is due)", "GPU 1: a row remapping failed"]


def test_fields_a_gpu_does_not_support_are_not_errors():
    consumer = rows("0, 00000000:01:00.0, [Not Supported], [N/A]")
    assert gpucheck.parse(consumer, [], expected=1) == []


def test_an_unexpected_line_is_reported_not_raised():
    assert gpucheck.parse([["garbage"]], [], expected=1) == [
        "nvidia-smi printed an unexpected line: garbage"]


def test_a_node_without_nvidia_smi_is_a_cpu_node_and_passes(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpucheck.check(expected=8, timeout=5) == []


def test_a_failing_nvidia_smi_makes_the_node_unhealthy(monkeypatch, tmp_path):
    # nvidia-smi's own words when the driver is gone.
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it couldn'\\''t communicate "
                   "with the NVIDIA driver.'\nexit 9\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    (problem,) = gpucheck.check(expected=1, timeout=5)
    assert problem.startswith("nvidia-smi failed: exit code 9: NVIDIA-SMI has failed")
