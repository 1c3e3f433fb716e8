# tunepack developer and quickstart commands. Everything runs in a local virtual environment.
PYTHON ?= python3.11
VENV ?= .venv
# torch goes in first, pinned. On Linux, PyPI's torch wheel is the CUDA build: with its NVIDIA
# libraries and triton the venv is about 6 GB. On a machine without a GPU, take PyTorch's CPU
# wheel instead, in a fresh venv (README, "What it installs"):
#   make quickstart TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# PyPI's macOS and Windows wheels are CPU builds already. TORCH_SPEC picks another version.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
QUICKSTART_DIR ?= .tunepack/quickstart
BIN := $(VENV)/bin

.PHONY: FORCE venv install dev quickstart test test-unit test-cluster controlplane node-runtime lint runtimes generate images images-local push-images clean

venv: $(BIN)/python
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Editable installs are strict: build/__editable__.* is a tree of links laid out as the import
# package, which static tools (IDEs, type checkers) follow; setuptools' default import hook they
# cannot. A module added later enters that tree at the next install: $(VENV)/.sources changes
# with the set of source files, and the install reruns (tests/integration/test_packaging.py).
EDITABLE := --config-settings editable_mode=strict
SOURCE_FILES := $(sort $(shell find sdk_ext runtimes initializers trainers -name '*.py' -o -name '*.yaml'))

$(VENV)/.sources: FORCE | $(BIN)/python
	@echo '$(SOURCE_FILES)' | cmp -s - $@ || echo '$(SOURCE_FILES)' > $@
FORCE:

# torchtune 0.6.1's own metadata asks for huggingface_hub[hf_transfer], an extra huggingface_hub
# 2.x no longer has (hf-xet replaced it; no download uses it), and pip warns of it at every
# install of tunepack: pip has no way to drop another package's requirement. That one line, matched
# whole, is left out of pip's stderr; all else pip says, and its exit status, stand (bash: the
# filter is a process substitution, so the command's status is pip's).
NO_HF_TRANSFER_WARNING := 2> >(grep -v -x "WARNING: huggingface-hub [^ ]* does not provide the extra 'hf-transfer'" >&2)

install: $(VENV)/.installed
$(VENV)/.installed $(VENV)/.dev-installed: SHELL := bash
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py $(VENV)/.sources
	$(BIN)/pip install -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[optimize]' $(EDITABLE) $(NO_HF_TRANSFER_WARNING)
	touch $@

dev: $(VENV)/.dev-installed
$(VENV)/.dev-installed: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev]' $(EDITABLE) $(NO_HF_TRANSFER_WARNING)
	touch $@

# A real LoRA fine-tune on the local backend: dataset-initializer -> model-initializer -> trainer.
quickstart: install
	$(BIN)/tunepack tiny-model $(QUICKSTART_DIR)/tiny-llama3
	$(BIN)/tunepack tiny-dataset $(QUICKSTART_DIR)/data/instructions.jsonl
	$(BIN)/tunepack train --local --runtime tunepack-tiny-llama3 \
		--workspace $(QUICKSTART_DIR)/workspace \
		--dataset file://$(abspath $(QUICKSTART_DIR))/data/instructions.jsonl \
		--model file://$(abspath $(QUICKSTART_DIR))/tiny-llama3 \
		method=lora epochs=3

# Test files run in parallel, one worker per CPU, each file's tests on one worker (their module
# fixtures are built once): tests/unit and tests/integration (tests/__init__.py says which holds
# what). A single test: $(BIN)/pytest -q tests/unit/test_x.py -k name
test: dev
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n auto --dist loadfile

# The quick loop while changing code: pure-Python tests only (about a minute).
test-unit: dev
	$(BIN)/pytest -q tests/unit

# The real control plane and node (etcd, Kubernetes 1.36 with kubelet and kube-proxy, Kubeflow
# Trainer v2.3.0, JobSet, KWOK, scheduler-plugins, Kueue, CNI plugins, CoreDNS), built from the Go
# module proxy with Go 1.26 and cached outside the checkout by version (tests/controlplane).
controlplane:
	bash tests/controlplane/build.sh

# The tier on the real control plane: install, admission, rendering, real runs (tests/cluster).
# The executed pods run on a real node (kubelet, containerd, pod network, kube-proxy, CoreDNS)
# in tunepack's images, built here first (images-local), inside a network namespace the tier
# makes for itself (tests/controlplane/netns.py); all of this needs root. TIER_NODE=0 runs
# the tests that need no node only (no root, no images; the executed runs are skipped).
TIER_NODE ?= 1
test-cluster: dev controlplane $(if $(filter 1,$(TIER_NODE)),images-local node-runtime)
ifeq ($(TIER_NODE),1)
	TUNEPACK_TIER_IMAGES=1 $(BIN)/python -m tests.controlplane.netns -- \
		$(BIN)/pytest -q -m controlplane tests/cluster
else
	$(BIN)/pytest -q -m controlplane tests/cluster
endif

# The real node's container runtime: Debian's containerd (apt-get when missing; root).
node-runtime:
	@command -v containerd >/dev/null || { echo "==> installing containerd (apt-get)"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q containerd >/dev/null; }
	@ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || { \
		echo "==> installing PostgreSQL (apt-get): the database of the tier's Katib"; \
		mkdir -p /etc/postgresql-common/createcluster.d; \
		echo 'create_main_cluster = false' > /etc/postgresql-common/createcluster.d/tunepack.conf; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; }

lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Regenerate runtimes/generated/*.yaml from the catalog (a test fails when they are stale).
runtimes: install
	$(BIN)/python -m tunepack.runtimes.generate

# Every generated file, after a change to the catalog, the methods or the trainer's vocabulary:
# each generator below has a --check mode, and a test fails while any file is stale or a module
# with --check is missing here (tests/unit/test_generate.py). Code first: the typed fields of
# TrainArgs and FineTune (and the docs' tables), then what is rendered from the catalog.
generate: install
	$(BIN)/python -m tunepack.runtimes.args_docs --write
	$(BIN)/python -m tunepack.finetune --write
	$(BIN)/python -m tunepack.runtimes.generate
	$(BIN)/python -m tunepack.runtimes.models_doc
	$(BIN)/python -m tunepack.tools.admission
	$(BIN)/python -m tunepack.tools.serving

# The three images the runtimes run (docker or podman; build from the repository root). Push them
# to your registry, then install the runtimes naming it (README, "Images"):
#   make push-images REGISTRY=registry.example.com/ml [TAG=...]
#   tunepack install --registry registry.example.com/ml [--tag ...]
# The tag defaults to tunepack's version, the one the generated runtimes name.
CONTAINER ?= docker
REGISTRY ?= ghcr.io/tunepack
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
TAG ?= $(VERSION)
IMAGES := dataset-initializer model-initializer trainer

images:
	$(CONTAINER) build -f initializers/Dockerfile --target dataset-initializer \
		-t $(REGISTRY)/dataset-initializer:$(TAG) .
	$(CONTAINER) build -f initializers/Dockerfile --target model-initializer \
		-t $(REGISTRY)/model-initializer:$(TAG) .
	$(CONTAINER) build -f trainers/Dockerfile -t $(REGISTRY)/trainer:$(TAG) .

# The same three images built on this machine without a registry: a Debian base made with
# debootstrap and buildah's layer cache, into local container storage (tests/controlplane/images.sh).
images-local:
	bash tests/controlplane/images.sh

push-images: images
	for image in $(IMAGES); do $(CONTAINER) push $(REGISTRY)/$$image:$(TAG) || exit 1; done
	@echo "pushed; install the runtimes naming them: tunepack install --registry $(REGISTRY)$(if $(filter $(VERSION),$(TAG)),, --tag $(TAG))"

clean:
	rm -rf $(VENV) .tunepack .pytest_cache .ruff_cache
