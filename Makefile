# Two entry points: `make demo` and `make test`. Both create .venv when missing.
# torch is pinned exactly here (a local CPU wheel on our machines); pyproject keeps a range.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP  := $(VENV)/.grouprl-installed

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadfile

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/grouprl train --output_dir runs/demo-$$(date +%Y%m%d-%H%M%S)

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	HF_HUB_OFFLINE=1 $(PY) benchmarks/vs_trl.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
