"""Step 2, the tests marked ``cuda``: tests/test_cuda.py run by pytest in a subprocess, its JUnit XML read
back into counts and failures.

The tests ship with the source checkout, not with the installed package: they run when the infinikv being
checked is a checkout's ``src/infinikv``; an installed one reports in one line that they were not run."""

from __future__ import annotations

import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

CUDA_TESTS = "tests/test_cuda.py"
NOT_RUN = "not run"
NO_CHECKOUT = f"{NOT_RUN} ({CUDA_TESTS} ships with the source checkout, not with the installed package)"


def checkout() -> Path | None:
    """The root of the source checkout that the running infinikv comes from, or None when it is installed."""
    import infinikv

    package = Path(infinikv.__file__).resolve().parent
    root = package.parent.parent
    return root if package.parent.name == "src" and (root / CUDA_TESTS).is_file() else None


def run_tests(out: Path, timeout: float) -> dict[str, Any]:
    """Run the tests marked ``cuda``; the log goes to ``cuda-tests.log`` and the JUnit XML to
    ``cuda-tests.xml`` in ``out``."""
    root = checkout()
    if root is None:
        return {"status": NO_CHECKOUT}
    xml = out / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", CUDA_TESTS]
    cmd += [f"--junitxml={xml}"]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root)
    except subprocess.TimeoutExpired as exc:
        (out / "cuda-tests.log").write_text(str(exc.stdout or "") + str(exc.stderr or ""))
        return {"status": "timeout", "timeout_s": timeout}
    (out / "cuda-tests.log").write_text(done.stdout + done.stderr)
    result: dict[str, Any] = {"returncode": done.returncode, "wall_s": round(time.perf_counter() - start, 1)}
    if xml.exists():
        result.update(parse_junit(xml))
    result["status"] = "passed" if done.returncode == 0 else "failed"
    return result


def parse_junit(xml: Path) -> dict[str, Any]:
    """Counts (tests, failures, errors, skipped) and one line per failed test from pytest's JUnit XML."""
    suite = ElementTree.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    result: dict[str, Any] = {key: int(suite.get(key, 0)) for key in keys}
    result["failed"] = []
    for case in suite.iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            result["failed"].append(f"{case.get('name')}: {problem.get('message', '')[:300]}")
    return result
