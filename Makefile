# Two set-up commands for a fresh machine (see README):
#   make demo   - creates .venv, installs everything, runs the main job: the quick study
#   make test   - creates .venv, installs everything, runs the whole test suite
# make study-full runs the full study; make demo-kill the kill-and-resume demonstration.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo study study-full demo-kill test test-slow bench bench-async bench-overhead bench-s3 install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch is pinned here (a CPU build on local disk); the package itself only needs torch>=2.4.
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0 -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: study

study: $(STAMP)
	$(BIN)/resurgo study --quick --out study-results

study-full: $(STAMP)
	$(BIN)/resurgo study --out study-results-full

demo-kill: $(STAMP)
	$(BIN)/python examples/demo_kill_resume.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_save_load.py

bench-async: $(STAMP)
	$(BIN)/python benchmarks/bench_async.py

bench-overhead: $(STAMP)
	$(BIN)/python benchmarks/bench_overhead.py

bench-s3: $(STAMP)
	$(BIN)/python benchmarks/bench_s3.py

clean:
	rm -rf $(VENV)
