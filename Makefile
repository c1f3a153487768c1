# Two entry points, both self-contained on a fresh machine:
#   make demo  - install into .venv, then run the main job on the embedded defaults
#   make test  - install into .venv (with dev extras), then ruff and the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
# torch is installed on its own first, pinned, so pip never swaps in another build;
# the range in pyproject.toml admits it.
TORCH_PIN ?= torch==2.13.0

CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install demo test lint clean browser

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q '$(TORCH_PIN)'
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) manage.py demo

# The dashboard tests drive a real Chromium through Playwright (Debian's package; Playwright's
# own browser download is not used).
browser:
	@test -x $(CHROMIUM) || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; }

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint browser
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var
