# The two commands of the README: `make demo` (the main job) and `make test`.
# Both install what they need first (apt packages as root, then .venv).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test bench clean install-mount

setup: $(VENV)/.ckptfs-setup

$(VENV)/.ckptfs-setup: pyproject.toml .ci/setup.sh .ci/setup-containers.sh
	VENV=$(VENV) bash .ci/setup.sh
	touch $@

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -ra $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/absorb.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# mount(8) helper (/sbin/mount.ckptfs) and the systemd unit ckptfs@.service, using this venv's ckptfs
install-mount: setup
	bash mount/install.sh --ckptfs $(abspath $(VENV))/bin/ckptfs
