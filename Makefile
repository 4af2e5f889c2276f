# Presto quick start:   make run    (CPU benchmark, end to end, real data;
#                                    ARGS="train.max_steps=20 ..." passes config overrides)
#                       make test   (the test suite)
#                       make check  (the unit tier: the edit loop)
#                       make mlperf-demo  (docs/MLPERF.md's commands at fixture scale)
# Each creates .venv when missing and installs the pinned requirements once;
# a second run installs nothing (the stamp file .venv/.stamp tracks the inputs).

PY       ?= python3
VENV     := .venv
VPY      := $(CURDIR)/$(VENV)/bin/python
STAMP    := $(VENV)/.stamp
WHEELS   ?= /opt/wheels
DATA     ?= data/cpu128
SOURCES  := .cache/sources
GENSIM_BZ2 := $(SOURCES)/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2
PYTEST_ARGS ?=
# The suite runs in two pytest-xdist workers, a whole test file per worker at a time (module
# fixtures such as one shared rank launch stay one launch), the files with slow tests first
# (tests/conftest.py's order, which --no-loadscope-reorder keeps); PYTEST_WORKERS=0 runs it in
# this process alone.
PYTEST_WORKERS ?= 2
XDIST    := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: venv run test check data sources system-deps clean-data bench-deps mlperf-demo venv-gpu

venv: $(STAMP)

$(STAMP): requirements.txt requirements-data.txt
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	@# torch: prefer the CPU wheel on disk; pip otherwise picks a multi-GB CUDA build.
	$(VPY) -m pip install --quiet --find-links $(WHEELS) -r requirements.txt
	$(VPY) -m pip install --quiet --no-deps -r requirements-data.txt
	@touch $(STAMP)

# The CUDA install (docs/GPU_QUICKSTART.md): the same pins with PyPI's torch 2.13.0, the CUDA
# 13.0 build (requirements-gpu.txt), never the local CPU wheel; a venv holding the CPU build has
# its torch replaced. It ends by saying what torch sees. `python -m bench.gpu_wheels` checks,
# without a GPU and without downloading the wheels, that the set resolves.
GPU_STAMP := $(VENV)/.stamp-gpu

venv-gpu: $(GPU_STAMP)

$(GPU_STAMP): requirements.txt requirements-data.txt requirements-gpu.txt
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	@$(VPY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null \
	  || $(VPY) -m pip uninstall --quiet --yes torch 2>/dev/null || true
	$(VPY) -m pip install --quiet -r requirements-gpu.txt
	$(VPY) -m pip install --quiet --no-deps -r requirements-data.txt
	$(VPY) -c "import torch, sys; ok = bool(torch.version.cuda); \
	  print(f'torch {torch.__version__}, CUDA {torch.version.cuda}:', \
	        f'{torch.cuda.device_count()} GPU(s) visible' if ok else 'NOT a CUDA build'); \
	  sys.exit(0 if ok else 1)"
	@touch $(STAMP) $(GPU_STAMP)

# Peer optimizers for `python -m bench.optim` (torch-optimizer, pytorch-lamb, timm): --no-deps,
# so torch stays 2.13.0 (requirements-bench.txt says what each import needs).
BENCH_STAMP := $(VENV)/.stamp-bench

bench-deps: $(BENCH_STAMP)

$(BENCH_STAMP): requirements-bench.txt | $(STAMP)
	$(VPY) -m pip install --quiet --no-deps -r requirements-bench.txt
	@touch $(BENCH_STAMP)

sources: $(GENSIM_BZ2)

# 106 full Wikipedia articles ship as a test file inside the gensim wheel; take
# just that file (docs/REFERENCES.md §8). PyPI is the only source.
$(GENSIM_BZ2): | $(STAMP)
	@mkdir -p $(SOURCES)/wheel
	$(VPY) -m pip download --quiet --no-deps --dest $(SOURCES)/wheel gensim==4.4.0
	cd $(SOURCES) && $(VPY) -c "import zipfile,glob,shutil,sys; \
	  z=zipfile.ZipFile(glob.glob('wheel/gensim-4.4.0-*.whl')[0]); \
	  n=[m for m in z.namelist() if m.endswith('$(notdir $(GENSIM_BZ2))')][0]; \
	  shutil.copyfileobj(z.open(n), open('$(notdir $(GENSIM_BZ2)).part','wb'))" \
	  && mv $(notdir $(GENSIM_BZ2)).part $(notdir $(GENSIM_BZ2))
	rm -rf $(SOURCES)/wheel

data: $(DATA)/stats.json

$(DATA)/stats.json: | $(STAMP) $(GENSIM_BZ2)
	$(VPY) -m loaders.prepare --out $(DATA)

CONFIG   ?= submission/configs/config_CPU_1x2x32x1.toml
# Config overrides for `make run`, as after run_and_time.sh's `--`: a short smoke run is
# make run ARGS="train.max_steps=20"
ARGS     ?=

run: venv sources data
	CONFIG=$(CONFIG) ./run_and_time.sh$(if $(strip $(ARGS)), -- $(ARGS))

# docs/MLPERF.md at fixture scale: the page's fixture commands, in order, as written there
# (python -m tests.support.walkthrough reads them from the page), into results/mlperf_demo/
# (emptied first: the runs of an earlier demo would be refused their finished directories).
DEMO     ?= results/mlperf_demo

mlperf-demo: venv
	rm -rf -- $(DEMO)
	$(VPY) -m tests.support.walkthrough --dir $(DEMO)

# Bytecode on: the suite starts a few hundred Python processes (ranks, launchers, stages), and
# an environment that sets PYTHONDONTWRITEBYTECODE makes each compile the repository's modules
# anew (~10 % of a rank's start-up CPU; __pycache__/ is ignored by git).
test: venv sources system-deps
	env -u PYTHONDONTWRITEBYTECODE $(VPY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The edit loop: the unit tier alone (no child process, no compile, a CPU budget a test, held
# by tests/conftest.py), in the same two workers. A room's tests across the tiers:
# make test PYTEST_ARGS="-m grad_sync" (python -m tests.support.rooms lists the rooms).
check: venv sources
	env -u PYTHONDONTWRITEBYTECODE $(VPY) -m pytest $(XDIST) tests/unit $(PYTEST_ARGS)

# Debian packages some tests launch for real (Open MPI's mpirun; iproute2's ip and tc for the
# slow-network test bed). Installed when missing and when we are root; otherwise those tests
# skip and say why.
system-deps:
	@command -v mpirun.openmpi >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin >/dev/null; } \
	  || echo "note: openmpi-bin not installed; the Open MPI launcher tests will skip"
	@command -v tc >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; } \
	  || echo "note: iproute2 not installed; the slow-network test bed tests will skip"

clean-data:
	rm -rf data
