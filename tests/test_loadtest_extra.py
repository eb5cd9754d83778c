"""Without the `loadtest` extra (matplotlib, ruamel.yaml), the commands that need it say so in
one sentence, before any work, and the rest run as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALL = "install the project's `loadtest` extra (pip install -e '.[loadtest]', as make does)"

# The extra's modules made unimportable, as on a machine where only the gateway was installed.
WITHOUT_EXTRA = """
import sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("matplotlib", "ruamel"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
from loadtest.cli import main
sys.exit(main(sys.argv[1:]))
"""


def loadtest_without_extra(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRA, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_plots_and_reports_name_the_extra(tmp_path: Path) -> None:
    # Port 9 (discard) is never reached: the check comes before any request.
    load = ("--url", "http://127.0.0.1:9", "--synthetic", "in=8,out=2", "--rate", "1",
            "--duration", "1")
    done = loadtest_without_extra("run", *load, "--plot", str(tmp_path / "r.png"))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("loadtest: error: --plot and --report need matplotlib, which is not "
                           f"installed here: {INSTALL}\n")
    done = loadtest_without_extra("overload", "--report", str(tmp_path / "o.html"))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("loadtest: error: --report needs matplotlib, which is not installed "
                           f"here: {INSTALL}\n")
    assert not (tmp_path / "r.png").exists() and not (tmp_path / "o.html").exists()


def test_calibrate_names_the_extra() -> None:
    done = loadtest_without_extra("calibrate", "--policy", "policies/demo.yaml", "--pool",
                                  "default", "--synthetic", "in=8,out=2")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("loadtest: error: calibrate needs ruamel.yaml to rewrite the policy, "
                           f"which is not installed here: {INSTALL}\n")


def test_a_run_without_plots_needs_no_extra() -> None:
    done = loadtest_without_extra("run", "--url", "http://127.0.0.1:9", "--synthetic", "in=8,out=2",
                                  "--rate", "1", "--duration", "1")
    assert done.returncode == 1  # as far as it goes with the extra: nothing listens there
    assert done.stderr.startswith("loadtest: error: cannot reach http://127.0.0.1:9: ")
