# Two entry points for a fresh machine (Python 3.10+): `make demo` and `make test`. Each creates .venv and
# installs lsvision with the pinned versions of constraints.txt first (only when those files changed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat setup.cfg pyproject.toml constraints.txt 2>/dev/null | cksum | cut -d' ' -f1)
CONTRACT := ../shared/tools/timm_contract/run.sh
CONTRACT_MODELS ?= cvt_ls_13,cvt_13,vil_ls_medium

.PHONY: install demo demo-listops demo-bytelm test lint unit contract clean

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench]'
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

demo: install
	$(PY) tools/demo.py

# sequence demos (no download): each trains long-short attention and its full-attention counterpart for 170 s each
demo-listops: install
	$(PY) tools/demo_listops.py --out output/demo/listops.json

demo-bytelm: install
	$(PY) tools/demo_bytelm.py --out output/demo/bytelm.json

test: lint unit contract

lint: install
	$(PY) -m ruff check .

unit: install
	$(PY) -m pytest -q

# timm's own tests/test_models.py against our models (the harness sits beside the checkout in CI)
contract: install
	@if [ -x $(CONTRACT) ]; then \
		PYTHON=$(PY) PKG=lsvision PKG_PATH=$(CURDIR) PKG_MODELS='$(CONTRACT_MODELS)' $(CONTRACT) -q; \
	elif [ -n "$$CI" ]; then \
		echo "contract: $(CONTRACT) is missing; CI needs ../shared beside the checkout" >&2; exit 1; \
	else \
		echo "contract: skipped, $(CONTRACT) not found (it sits beside the checkout in CI)"; \
	fi

clean:
	rm -rf $(VENV) *.egg-info
