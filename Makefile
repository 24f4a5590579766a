PYTHON ?= python3
PROTO_SRC := $(wildcard proto/mstar/v1/*.proto)

.PHONY: setup torch-cpu torch-gpu system-packages mooncake proto check-proto test lint typecheck serve bench
SYSTEM_PACKAGES ?= yes

# Versions: torch on CPU hosts; on GPU hosts a CUDA torch already installed is kept, else the
# pinned CUDA build below is installed; FlashInfer and the two wheels it imports, as measured with
# torch 2.11+cu130 on H100 (equal to pyproject.toml's `gpu` extra: tests/setup/test_versions.py).
TORCH_CPU := torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CUDA := torch==2.11.0
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu130
FLASHINFER := flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0
# what FlashInfer needs at import and for its JIT builds (its heavier optional dependencies are left out)
FLASHINFER_RUNTIME := ninja packaging requests tqdm nvidia-ml-py einops
# the package's extras: every model family and the dev tools (EXTRAS=orpheus: serve Orpheus, no test tools)
EXTRAS ?= dev,all
# triton on a CPU host serves only the Triton kernels' tests in its interpreter, and its wheel is 286 MB
# (~1 GB installed, mostly CUDA and ROCm backends): added only when asked (TRITON=yes; .ci/run asks).
# A CUDA torch brings its own.
TRITON ?= no
comma := ,
# a GPU host: nvidia-smi lists a GPU
GPU_HOST := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo yes)

# torch (CPU, or CUDA + FlashInfer on a GPU host), this package with every model family and its
# dev tools, the stubs; then Mooncake (optional: without it tensors cross hosts inline): the system
# libraries its engine links and its CUDA wheel where an NVIDIA driver is, the non-CUDA one elsewhere.
setup:
ifeq ($(GPU_HOST),yes)
	$(MAKE) torch-gpu
else
	$(MAKE) torch-cpu
endif
	$(PYTHON) -m pip install -e '.[$(EXTRAS)$(if $(filter yes,$(TRITON)),$(comma)triton)]'
	@if $(PYTHON) -c "import grpc_tools" 2>/dev/null; then $(MAKE) proto; \
	else echo "note: grpcio-tools is not installed (EXTRAS=$(EXTRAS) has no dev): the committed stubs in mstar/v1/ stay"; fi
	$(MAKE) system-packages
	$(MAKE) mooncake
	@$(PYTHON) -c "from mstar.services.transport import mooncake as m; print('mooncake:', 'available' if m.available() else m.unavailable_reason())" || true
	@$(PYTHON) -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"

# The CPU build, from PyTorch's CPU index: PyPI's Linux torch is the CUDA build, ~3 GB of nvidia
# wheels with it. Where that index cannot be reached (a mirror or proxy that serves only PyPI), pip's
# default index, saying so once. A CPU torch of the pinned version already installed is kept.
torch-cpu:
	@if $(PYTHON) -c "import sys, torch; sys.exit(0 if torch.__version__.split('+')[0] == '$(patsubst torch==%,%,$(TORCH_CPU))' and not torch.version.cuda else 1)" 2>/dev/null; then \
	  echo "keeping torch $$($(PYTHON) -c 'import torch; print(torch.__version__)' 2>/dev/null) (a CPU build is installed)"; \
	elif $(PYTHON) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" 2>/dev/null; then \
	  $(PYTHON) -m pip install $(TORCH_CPU) --index-url $(TORCH_CPU_INDEX); \
	else echo "note: $(TORCH_CPU_INDEX) cannot be reached; $(TORCH_CPU) comes from pip's default index instead (PyPI's Linux torch is the CUDA build, ~3 GB more)"; \
	  $(PYTHON) -m pip install $(TORCH_CPU); fi

# A CUDA torch already installed (the GPU image's) is kept; otherwise the pinned CUDA build.
# FlashInfer goes in with --no-deps: the three wheels measured together (GPU.md), plus its small
# runtime needs.
torch-gpu:
	@if $(PYTHON) -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
	  echo "keeping torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') (a CUDA build is installed)"; \
	else $(PYTHON) -m pip install $(TORCH_CUDA) --index-url $(TORCH_CUDA_INDEX); fi
	$(PYTHON) -m pip install --no-deps $(FLASHINFER)
	$(PYTHON) -m pip install $(FLASHINFER_RUNTIME)
	@$(PYTHON) -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, 'on torch', torch.__version__)"

# Optional: the Mooncake wheel, CUDA where an NVIDIA driver is, non-CUDA elsewhere. Where none can be
# installed (no index, no wheel for this platform) one note says so, with pip's reason.
mooncake:
	@if command -v nvidia-smi >/dev/null 2>&1; then extra=mooncake; else extra=mooncake-cpu; fi; \
	if out=$$($(PYTHON) -m pip install -e ".[$$extra]" 2>&1); then printf '%s\n' "$$out" | grep '^Successfully' || true; \
	else echo "note: no Mooncake wheel installed ($$extra; pip: $$(printf '%s\n' "$$out" | grep '^ERROR' | tail -1 | cut -c8-)); tensors cross hosts inline"; fi

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

print-%:  # a variable, for scripts: make -s print-FLASHINFER
	@echo $($*)

# Generated stubs live in mstar/v1/ and are committed; tests/test_proto_fresh.py fails if stale.
proto:
	$(PYTHON) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

# Two workers (the CI machine's two cores); a test file stays on one worker, so a module's shared
# mesh starts once. One worker: make test PYTEST_WORKERS=0
PYTEST_WORKERS ?= 2
test:
	$(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=15 -rs

lint:
	$(PYTHON) -m ruff check .
	$(MAKE) --no-print-directory typecheck

# mypy as configured in pyproject.toml ([tool.mypy]): it reads the folders, which install as
# subpackages of mstar, through build/mypy/mstar (links laid out as installed)
typecheck:
	@rm -rf build/mypy && mkdir -p build/mypy/mstar
	@for f in mstar/*; do ln -s "$(CURDIR)/$$f" build/mypy/mstar/; done
	@for d in services conductor gateway models; do ln -s "$(CURDIR)/$$d" build/mypy/mstar/$$d; done
	$(PYTHON) -m mypy

serve:
	mstar serve toy

bench:
	$(PYTHON) bench/mesh.py --out bench/results/mesh.json
