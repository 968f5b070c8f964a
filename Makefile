# Two set-up commands for a fresh machine (see README):
#   make demo   - creates .venv, installs everything, runs the main job: the quick study
#   make test   - creates .venv, installs everything, runs the whole test suite
# make study-full runs the full study; make demo-kill the kill-and-resume demonstration.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The DeepSpeed import tests train real ZeRO-1/2/3 jobs on CPU (gloo, no compiled ops). deepspeed
# and its small pure-Python dependencies go into $(DS_SITE), not the environment (deepspeed's setup
# imports torch while it builds, so it is no ordinary dependency): resurgo never imports deepspeed,
# only these tests do.
DS_SITE := .deepspeed-site
DS_PYTEST := PYTHONPATH=$(DS_SITE) DS_ACCELERATOR=cpu DS_BUILD_OPS=0 $(BIN)/python -m pytest -q -m deepspeed

# The torchtitan tests run real torchtitan jobs on CPU. torchtitan and the dependencies it imports
# go into $(TT_SITE), outside the environment (torchtitan pulls in datasets, pyarrow, pandas and
# tensorboard, about 300 MB, and imports triton at start-up even on CPU: 290 MB more; about 30 s to
# install here): resurgo imports torchtitan only in resurgo.integrations.torchtitan.
# The path is absolute: the doc tests run in their own directories.
TT_SITE := .torchtitan-site
TT_PYTEST := PYTHONPATH=$(CURDIR)/$(TT_SITE) $(BIN)/python -m pytest -q -m torchtitan

# The Megatron import tests compare with Megatron-Core's own views of checkpoints it writes on CPU
# (gloo). megatron-core (pure Python; its other dependencies, numpy and packaging, are in the
# environment) goes into $(MC_SITE), outside the environment: resurgo never imports megatron.
MC_SITE := .megatron-site
MC_PYTEST := PYTHONPATH=$(CURDIR)/$(MC_SITE) $(BIN)/python -m pytest -q -m megatron

.PHONY: demo study study-full study-frameworks demo-kill test typecheck test-bench test-slow test-deepspeed test-megatron test-torchtitan bench bench-async bench-overhead bench-s3 bench-import bench-incremental bench-planning bench-memory bench-shared docs docs-build install lock clean

# The environment installs with every package pinned by $(LOCK), given as constraints: pip has
# one version of each to consider, so it does not backtrack (unpinned, its resolver spent 7-10
# minutes in s3fs, aiobotocore and botocore). Constraints, not --no-deps: a CUDA torch elsewhere
# brings nvidia-* packages a lock made on a CPU machine does not list, and pip may still add them.
# make lock resolves the dev extra afresh and rewrites $(LOCK); make install LOCK= installs unpinned.
TORCH := 2.13.0
LOCK ?= requirements/dev.lock
LOCK_VENV := .venv-lock

$(STAMP): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	# torch is pinned here; the package itself only needs torch>=2.4. Where pip finds no local CPU
	# wheel it installs the default build from PyPI, which on Linux is a CUDA build that brings
	# about 2.7 GB of NVIDIA libraries. For the CPU build, install it first, then run make:
	#   python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
	$(BIN)/pip install --quiet --disable-pip-version-check $(if $(LOCK),-c $(LOCK)) torch==$(TORCH) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Pins what pip resolves today for torch==$(TORCH) and the dev extra, in a new environment (the
# resolver's minutes are spent here, once). Local version labels are dropped (2.13.0+cpu pins
# 2.13.0), so that the same lock serves a CUDA torch; tests/test_lock.py holds it to pyproject.
lock:
	rm -rf $(LOCK_VENV)
	$(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install --quiet --disable-pip-version-check torch==$(TORCH) -e '.[dev]'
	mkdir -p requirements
	{ echo "# Every package of the dev environment (torch==$(TORCH) -e '.[dev]'), pinned. Regenerate: make lock"; \
	  $(LOCK_VENV)/bin/python -c 'import platform as p; print("# Resolved on Python", p.python_version(), p.system(), p.machine())'; \
	  $(LOCK_VENV)/bin/pip freeze --exclude-editable --disable-pip-version-check | sed -E 's/\+[A-Za-z0-9.]+$$//'; \
	} > requirements/dev.lock.tmp
	mv requirements/dev.lock.tmp requirements/dev.lock
	rm -rf $(LOCK_VENV)

demo: study

study: $(STAMP)
	$(BIN)/resurgo study --quick --out study-results

# TensorFlow, JAX/Orbax and Chainer beside PyTorch, each in a pinned virtualenv made on first use
study-frameworks: $(STAMP)
	$(BIN)/resurgo study --quick --frameworks tensorflow,jax,chainer --out study-results-frameworks

study-full: $(STAMP)
	$(BIN)/resurgo study --out study-results-full

demo-kill: $(STAMP)
	$(BIN)/python examples/demo_kill_resume.py

# The default suite, then the DeepSpeed, Megatron and torchtitan tests (deselected by default: they
# need packages that live outside the environment, in $(DS_SITE), $(MC_SITE) and $(TT_SITE)), then
# mypy and the benchmark and study smoke runs (a minute each, kept out of the default suite's time).
test: $(STAMP) $(DS_SITE)/.installed $(MC_SITE)/.installed $(TT_SITE)/.installed
	$(BIN)/python -m pytest -q --durations=20
	$(DS_PYTEST)
	$(MC_PYTEST)
	$(TT_PYTEST)
	$(BIN)/python -m pytest -q -m 'typecheck or bench'

typecheck: $(STAMP)
	$(BIN)/python -m pytest -q -m typecheck

test-bench: $(STAMP)
	$(BIN)/python -m pytest -q -m bench

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

$(DS_SITE)/.installed: $(STAMP)
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet --disable-pip-version-check --no-deps --target $(DS_SITE) \
		deepspeed==0.19.8 hjson==3.1.0 ninja==1.13.2 py-cpuinfo==9.0.0 msgpack==1.2.4 psutil==7.2.2 einops==0.8.2 tqdm==4.70.1
	touch $@

test-deepspeed: $(DS_SITE)/.installed
	$(DS_PYTEST)

$(MC_SITE)/.installed: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --target $(MC_SITE) megatron-core==0.16.1
	touch $@

test-megatron: $(MC_SITE)/.installed
	$(MC_PYTEST)

$(TT_SITE)/.installed: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --target $(TT_SITE) \
		torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 shtab==1.13.0 \
		einops==0.8.2 tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1 datasets==4.7.0 pyarrow==26.0.1 \
		dill==0.4.1 multiprocess==0.70.19 pandas==3.1.1 python-dateutil==4.0.0 pytz==2026.6 tzdata==2026.6 \
		httpx==0.28.1 httpcore==1.0.9 sniffio==1.3.1 triton==3.9.0
	touch $@

test-torchtitan: $(TT_SITE)/.installed
	$(TT_PYTEST)

# Import of a ~1 GiB DeepSpeed ZeRO-2 and DCP checkpoint against zero_to_fp32 and dcp_to_torch_save.
bench-import: $(DS_SITE)/.installed
	PYTHONPATH=$(DS_SITE) DS_ACCELERATOR=cpu $(BIN)/python benchmarks/bench_import.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_save_load.py

bench-async: $(STAMP)
	$(BIN)/python benchmarks/bench_async.py

bench-incremental: $(STAMP)
	$(BIN)/python benchmarks/bench_incremental.py

bench-overhead: $(STAMP)
	$(BIN)/python benchmarks/bench_overhead.py

# Save planning and load metadata from 1 to 16,384 simulated ranks, DCP's .metadata on 2-8 gloo ranks.
bench-planning: $(STAMP)
	$(BIN)/python benchmarks/bench_planning.py

bench-shared: $(STAMP)
	$(BIN)/python benchmarks/bench_shared_read.py

bench-s3: $(STAMP)
	$(BIN)/python benchmarks/bench_s3.py

# The memory tier (4 gloo ranks on 2 simulated nodes) against a local-disk save and S3 (SeaweedFS).
bench-memory: $(STAMP)
	$(BIN)/python benchmarks/bench_memory_tier.py

# The documentation site (mkdocs-material, API reference by mkdocstrings): `make docs` serves it at
# http://127.0.0.1:8000; `make docs-build` builds it into site/, strict (tests/test_api_docs.py does too).
docs: $(STAMP)
	$(BIN)/mkdocs serve

docs-build: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV)
