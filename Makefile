PYTHON ?= python3
PROTO_SRC := $(wildcard proto/mstar/v1/*.proto)

.PHONY: setup system-packages proto check-proto test lint serve bench
SYSTEM_PACKAGES ?= yes

# torch, this package with its dev tools, the stubs; then Mooncake (optional: without it
# tensors cross hosts inline): the system libraries its engine links (soname:Debian package),
# installed when missing, and its CUDA wheel where an NVIDIA driver is, the non-CUDA one elsewhere.
setup:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'
	$(MAKE) proto
	$(MAKE) system-packages
	@if command -v nvidia-smi >/dev/null 2>&1; then extra=mooncake; else extra=mooncake-cpu; fi; \
	$(PYTHON) -m pip install -e ".[$$extra]" || echo "note: no Mooncake wheel installed ($$extra); tensors cross hosts inline"
	@$(PYTHON) -c "from mstar.services.transport import mooncake as m; print('mooncake:', 'available' if m.available() else m.unavailable_reason())"

# Optional: the system libraries Mooncake's engine links (soname:Debian package), installed with
# apt-get when missing and we are root (SYSTEM_PACKAGES=no skips it). Never fails setup: an apt lock
# held elsewhere, no network or no apt only leave a warning (tensors then cross hosts inline).
system-packages:
	@missing=""; for lib in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do \
	  (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null | grep -q "$${lib%%:*}" || missing="$$missing $${lib#*:}"; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$(SYSTEM_PACKAGES)" = no ]; then echo "note: SYSTEM_PACKAGES=no: not installing$$missing (for Mooncake)"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "apt-get install$$missing (optional, for Mooncake)"; \
	  { apt-get -o DPkg::Lock::Timeout=30 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=30 \
	      install -y -qq --no-install-recommends $$missing; } \
	  || echo "warning: apt-get could not install$$missing (apt lock held elsewhere? no network?); setup goes on without them: Mooncake stays unavailable until you run apt-get install -y$$missing"; \
	else echo "note: Mooncake needs the system packages$$missing; install them as root (apt-get install -y$$missing)"; fi

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
