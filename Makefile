PYTHON ?= python3
PROTO_SRC := $(wildcard proto/mstar/v1/*.proto)

.PHONY: setup proto check-proto test lint serve bench

# torch, this package with its dev tools, the stubs; then Mooncake (optional: without it
# tensors cross hosts inline): the system libraries its engine links (soname:Debian package),
# installed when missing, and its CUDA wheel where an NVIDIA driver is, the non-CUDA one elsewhere.
setup:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'
	$(MAKE) proto
	@missing=""; for lib in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do \
	  (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null | grep -q "$${lib%%:*}" || missing="$$missing $${lib#*:}"; done; \
	if [ -z "$$missing" ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "apt-get install$$missing (for Mooncake)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "note: Mooncake needs the system packages$$missing; install them as root (apt-get install -y$$missing)"; fi
	@if command -v nvidia-smi >/dev/null 2>&1; then extra=mooncake; else extra=mooncake-cpu; fi; \
	$(PYTHON) -m pip install -e ".[$$extra]" || echo "note: no Mooncake wheel installed ($$extra); tensors cross hosts inline"
	@$(PYTHON) -c "from mstar.services.transport import mooncake as m; print('mooncake:', 'available' if m.available() else m.unavailable_reason())"

# Generated stubs live in mstar/v1/ and are committed; tests/test_proto_fresh.py fails if stale.
proto:
	$(PYTHON) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

test:
	$(PYTHON) -m pytest --durations=15

lint:
	$(PYTHON) -m ruff check .

serve:
	mstar serve toy

bench:
	$(PYTHON) bench/mesh.py --out bench/results/mesh.json
