import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_and_frontend_install_under_the_radixkv_namespace(tmp_path):
    # Run outside the checkout, so only the installed package can be found.
    code = (
        "import importlib.util, radixkv.kernels, radixkv.frontend;"
        "print(radixkv.kernels.__file__); print(radixkv.frontend.__file__);"
        "print(importlib.util.find_spec('kernels') is None, importlib.util.find_spec('frontend') is None)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    kernels, frontend, flags = out.stdout.splitlines()
    assert Path(kernels) == ROOT / "kernels" / "__init__.py"
    assert Path(frontend) == ROOT / "frontend" / "__init__.py"
    assert flags == "True True"  # nothing named `kernels` or `frontend` at top level


def test_console_script_runs():
    out = subprocess.run([Path(sys.executable).parent / "radixkv", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "demo" in out.stdout and "sim" in out.stdout


def test_paged_generate_example_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "paged_generate.py")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) >= 3  # some words of an answer


def test_the_wheel_carries_what_bench_and_sim_need(tmp_path):
    """radixkv bench and radixkv sim --workload rag|agent run from the installed package:
    the workload programs, the recorder and the bench core are in the wheel, the peers
    (benchmarks/) are not."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)  # fmt: skip
    (wheel,) = tmp_path.glob("radixkv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("workloads/__init__.py", "workloads/programs.py", "workloads/recorder.py", "workloads/bench.py",
                   "cache/manager.py", "model/batch.py", "validate.py", "kernels/cpu_decode.c", "kernels/qmatmul.c",
                   "kernels/vexp.h"):  # fmt: skip
        assert f"radixkv/{module}" in names, module
    assert not any(n.startswith("benchmarks/") for n in names)
