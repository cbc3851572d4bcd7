# Two entry points for a fresh machine (Python 3.10+): `make demo` and `make test`. Each creates .venv and
# installs lsvision with the pinned versions of constraints.txt first (only when those files changed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat setup.cfg pyproject.toml constraints.txt 2>/dev/null | cksum | cut -d' ' -f1)
# models for `make contract` (fnmatch patterns, '*' = all); empty: contract/run.py's default subset
CONTRACT_MODELS ?=

.PHONY: install demo models demo-listops demo-bytelm demo-hsw bench-hsw test lint unit contract sweep cards gpu-check clean

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench,eval,corrupt,onnx,detect,text]'
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

# trains a small long-short model on scikit-learn's bundled digits (CPU, time-budgeted) and evaluates it
demo: install
	$(PY) tools/train.py

# builds every lsvision model: params, GFLOPs, output shape
models: install
	$(PY) tools/demo.py

# sequence demos (no download): each trains long-short attention and its full-attention counterpart for 170 s each
demo-listops: install
	$(PY) tools/demo_listops.py --out output/demo/listops.json

demo-bytelm: install
	$(PY) tools/demo_bytelm.py --out output/demo/bytelm.json

# HSW long-document demo on the stdlib's source (time-budgeted, <= 5 min on 2 cores) and its speed benchmark
demo-hsw: install
	$(PY) tools/demo_hsw.py

bench-hsw: install
	$(PY) tools/benchmark.py --suite hsw

test: lint unit contract

lint: install
	$(PY) -m ruff check .

unit: install
	$(PY) -m pytest -q

# timm's own tests/test_models.py (from the sdist of the installed timm, cached in contract/.cache) on our models
contract: install
	$(PY) contract/run.py $(if $(CONTRACT_MODELS),--models '$(CONTRACT_MODELS)')

# cvt_ls_13 vs cvt_13, time and peak memory against input size (docs/benchmarks/); about 15 min on 2 idle cores
sweep: install
	$(PY) tools/benchmark.py sweep

# measure every model and regenerate model_cards/ and README's models table
cards: install
	$(PY) tools/benchmark.py cards

# on a machine with a CUDA device: tests/test_cuda.py + a train-step benchmark -> docs/benchmarks/gpu.md (< 8 min)
gpu-check: install
	$(PY) tools/gpu_check.py

clean:
	rm -rf $(VENV) *.egg-info contract/.cache
