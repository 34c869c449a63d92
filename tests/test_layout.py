import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_platform_source_root_does_not_shadow_the_standard_library():
    assert not (ROOT / "platform" / "__init__.py").exists()
    # The project's own source roots are on sys.path here (pytest pythonpath), as in every process it runs.
    import platform

    assert platform.system() in {"Linux", "Darwin", "Windows"}
    assert Path(platform.__file__).parent != ROOT


def test_stdlib_platform_works_in_a_process_started_like_the_platform():
    code = "import platform, loom.settings; print(platform.system())"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}", "PATH": "/usr/bin:/bin", "LOOM_DEBUG": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Linux"
