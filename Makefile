# Two commands on a fresh machine: `make demo` and `make test`. Each bootstraps .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# A CPU wheel of this torch lies on the CI machines' disk; elsewhere pip fetches it. Override
# for a GPU box: make TORCH_SPEC='torch==2.13.0 --index-url ...' test
TORCH_SPEC ?= torch==2.13.0
PYTEST := $(PY) -m pytest

.PHONY: demo test test-profile test-fast test-ray bench bytecode system-packages clean

# uv installs in under 30 s what pip took one to two minutes for here (parallel downloads, bytecode
# compiled on every core). The bytecode is made at install: these machines set
# PYTHONDONTWRITEBYTECODE, so without it every process compiles all it imports (the suite ran 1145 s
# instead of ~875). uv reads none of pip's settings: the disk's wheels (PIP_FIND_LINKS, a CPU torch
# on CI machines) are passed on; where uv fails (a registry's 503 that pip's configured mirror would
# have served, a certificate only pip is told of, no uv at all) pip installs, with all its settings.
UV_INSTALL := $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(foreach links,$(PIP_FIND_LINKS),--find-links $(links))
install = $(UV_INSTALL) $(1) || $(PY) -m pip install -q $(1)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	-$(PY) -m pip install -q uv==0.13.9
	$(call install,$(TORCH_SPEC))
	# grafana-client brings niquests and urllib3-future, whose wheel overwrites urllib3 itself at
	# every interpreter start (requests and schemathesis then misbehave). Built from source with
	# URLLIB3_NO_OVERRIDE it stays beside urllib3, as its authors advise.
	export URLLIB3_NO_OVERRIDE=1; $(call install,--no-binary urllib3-future urllib3-future)
	$(call install,-e '.[dev]')
	touch $(STAMP)

# These machines set PYTHONDONTWRITEBYTECODE, so no process writes .pyc files: every process (each
# Ray worker of every job) compiled the repo's modules it imports again, ~80 ms of CPU each. They
# are written here, once per command (Python still reads them; a stale one is recompiled in memory).
bytecode: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q -j0 trainers cluster service bench tests/fixtures > /dev/null

# What the suite needs from the system (Prometheus, Chromium, sshd, ...): installed when this runs
# as root or with password-less sudo, else named with the command to install them, and the suite
# does not start. It comes first, before the venv is built. The list is tests/system_packages.sh.
system-packages:
	bash tests/system_packages.sh

demo: $(STAMP) bytecode
	$(VENV)/bin/etrain demo

# The whole suite: unit (no Ray), integration (a local Ray), e2e. The rehearsed cloud, then the
# code tenant and a few modules (in namespaces of their own) run beside the rest (tests/lanes.py);
# `$(PYTEST) tests --ignore=tests/gpu` runs all of it in one lane.
test: system-packages $(STAMP) bytecode
	$(PY) tests/lanes.py -q --durations=15

# Where the suite's CPU goes (it is CPU-bound on 2 cores): the whole suite as `make test` runs it,
# each test's CPU seconds (with everything it started) in cpu-profile.jsonl, then a summary.
test-profile: system-packages $(STAMP) bytecode
	rm -f cpu-profile.jsonl
	ETRAIN_CPU_PROFILE=$(CURDIR)/cpu-profile.jsonl $(PY) tests/lanes.py -q; \
	status=$$?; $(PY) tests/fixtures/cpu_profile.py cpu-profile.jsonl; exit $$status

# The fast tier for your own loop: no Ray is started, under a minute. Its tests wait on processes
# and servers of their own as much as they compute: one pytest worker per core (~40 s, not ~62, here).
test-fast: $(STAMP) bytecode
	$(PYTEST) tests/unit -q -n auto

test-ray: system-packages $(STAMP) bytecode
	$(PYTEST) tests/integration -q

# Side-by-side ratios measured in one run (see bench/); writes BENCHMARKS.md. Each script also
# runs on its own: python bench/NAME.py
bench: $(STAMP) bytecode
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache
