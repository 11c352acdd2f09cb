"""Every command that plots fails at once, naming the extra to install, when matplotlib is missing
(after `pip install linattn` without extras), instead of crashing at its end after all the work."""

import subprocess
import sys
from pathlib import Path

import pytest

import linattn.bench.favor
import linattn.bench.full
import linattn.bench.sweep
import linattn.experiments.common
from linattn.cli import main
from linattn.extras import EXTRAS, require_extra

ROOT = Path(__file__).resolve().parents[1]


class WorkStarted(Exception):
    """Raised by the first piece of real work of a command: the check came too late."""


def _refuse(*args, **kwargs):
    raise WorkStarted("the command started working before checking for matplotlib")


@pytest.fixture
def no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises, find_spec says None


# argv -> (the module attribute whose call is the command's first piece of work, the command the
# message names, the extra it must name)
COMMANDS = {
    "demo --ns 16": ((linattn.bench.sweep, "run_sweep"), "linattn demo", "bench"),
    "bench sweep --ns 16": ((linattn.bench.sweep, "OtherLoad"), "linattn bench sweep", "bench"),
    "bench": ((linattn.bench.sweep, "OtherLoad"), "linattn bench sweep", "bench"),
    "bench full": ((linattn.bench.full, "run_sweep"), "linattn bench full", "bench"),
    "bench favor --what approx": ((linattn.bench.favor, "approximation_errors"),
                                  "linattn bench favor --what approx", "bench"),
    **{f"experiment {name} --quick": ((linattn.experiments.common, "RunFolder"), f"linattn experiment {name}",
                                      "experiments")
       for name in ("copy", "mnist", "shakespeare", "proteins")},
}


@pytest.mark.parametrize("argv", COMMANDS)
def test_plotting_commands_fail_before_work_without_matplotlib(argv, no_matplotlib, monkeypatch, tmp_path, capsys):
    (module, first_work), command, extra = COMMANDS[argv]
    monkeypatch.setattr(module, first_work, _refuse)
    monkeypatch.chdir(tmp_path)  # default output folders would land here
    with pytest.raises(SystemExit) as info:  # the usual one-line usage error, not a traceback
        main(argv.split())
    assert info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(f"linattn: error: {command} needs matplotlib")
    assert f"pip install 'linattn[{extra}]'" in message
    assert list(tmp_path.iterdir()) == []  # no run folder, no report


def test_commands_that_do_not_plot_run_without_matplotlib(no_matplotlib, tmp_path, capsys):
    # rebuilding the benchmark document draws nothing: it reaches its own error, not the extra's
    with pytest.raises(SystemExit):
        main(["bench", "full", "--doc-only", "--out", str(tmp_path / "none"), "--doc", str(tmp_path / "d.md")])
    assert "sweep.json" in capsys.readouterr().err
    assert main(["bench", "family", "--n-local", "16", "--n-softmax", "8", "--repeats", "1",
                 "--out", str(tmp_path)]) == 0


def test_require_extra_passes_when_installed_and_rejects_unknown_extras():
    pytest.importorskip("matplotlib")
    require_extra("bench", command="x")
    with pytest.raises(ValueError, match="unknown extra 'plots'"):
        require_extra("plots", command="x")


def test_the_named_extras_exist_and_provide_what_is_checked():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, packages in EXTRAS.items():
        declared = {req.split(">")[0].split("=")[0].split("<")[0].strip() for req in extras.get(extra, [])}
        assert set(packages) <= declared, f"extra {extra!r} declares {sorted(declared)}, lacks {packages}"


def test_import_linattn_does_not_import_matplotlib():
    code = "import sys, linattn, linattn.extras; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
