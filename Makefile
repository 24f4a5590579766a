PYTHON ?= python3
PROTO_SRC := $(wildcard proto/mstar/v1/*.proto)

.PHONY: setup proto check-proto test lint serve bench

setup:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'
	$(MAKE) proto

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
