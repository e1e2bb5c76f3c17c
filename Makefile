# The commands of the README: `make demo` (the main job), `make test` and `make bench`.
# Each installs what it needs first (apt packages as root, then .venv); only bench needs
# the bench extra (matplotlib, deepspeed), installed by `make bench-setup` (setup.sh --bench, a superset).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: setup bench-setup demo test bench clean install-mount

setup: $(VENV)/.ckptfs-setup

$(VENV)/.ckptfs-setup: pyproject.toml .ci/setup.sh .ci/setup-containers.sh
	VENV=$(VENV) bash .ci/setup.sh
	touch $@

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -ra $(PYTEST_ARGS)

bench-setup: $(VENV)/.ckptfs-bench-setup

$(VENV)/.ckptfs-bench-setup: pyproject.toml .ci/setup.sh
	VENV=$(VENV) bash .ci/setup.sh --bench
	touch $@

bench: bench-setup
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# mount(8) helper (/sbin/mount.ckptfs) and the systemd unit ckptfs@.service, using this venv's ckptfs
install-mount: setup
	bash mount/install.sh --ckptfs $(abspath $(VENV))/bin/ckptfs
