# Entry points. `make demo` and `make test` install missing Debian packages themselves.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHXFER_BUILD_TESTS=ON -DHXFER_BUILD_BENCHMARKS=ON

.PHONY: all deps configure build test test-asan test-tsan test-vllm vllm-venv soak demo bench fuzz \
  format clean

all: build

deps:
	@bash scripts/install-deps.sh

configure: deps
	@cmake -S . -B $(BUILD_DIR) -G Ninja $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 600

# The whole suite under AddressSanitizer + UndefinedBehaviorSanitizer (its own build dir).
test-asan: deps
	@cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DHXFER_BUILD_TESTS=ON \
	  -DHXFER_SANITIZE=address,undefined >/dev/null
	@cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS) --timeout 900

# The concurrent layers (cache, transport, engine, api, device) under ThreadSanitizer. UCX's memory hooks
# (libucm patching madvise/mmap) run inside exiting threads after TSan tore down their state
# and crash there, so they are off for this run (they serve RDMA registration caches only).
test-tsan: deps
	@cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DHXFER_BUILD_TESTS=ON \
	  -DHXFER_SANITIZE=thread >/dev/null
	@cmake --build build-tsan -j $(JOBS) --target cache_test transport_test transport_hostile_test engine_routing_test \
	  engine_transceiver_test engine_reliability_test engine_soak_test api_test hxfer_shared \
	  device_test
	cd build-tsan && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" UCX_MEM_MMAP_HOOK_MODE=none \
	  ctest --output-on-failure -j $(JOBS) --timeout 900 -L '^(cache|transport|engine|api|device)$$'

# The real-engine test (tests/vllm/README.md): vLLM CPU 0.32 prefill/decode pairs moving KV and
# Mamba state through NIXL and through hxfer's connector must give the tokens of one instance.
# Not part of `make test`: a 6.5 GB venv (3.2 GB download, reused), and 10-20 minutes of vLLM
# instances on 2 cores. PYTEST_ARGS narrows it (e.g. PYTEST_ARGS='-k nixl').
VLLM_VENV ?= $(CURDIR)/$(BUILD_DIR)/vllm-venv
VLLM_MODELS ?= $(CURDIR)/$(BUILD_DIR)/vllm-models
VLLM_WORK ?= $(CURDIR)/$(BUILD_DIR)/vllm-test
vllm-venv: deps
	@HXFER_VLLM_VENV=$(VLLM_VENV) bash tests/vllm/setup.sh

$(VLLM_MODELS)/models.json: tests/vllm/make_models.py tests/vllm/constraints.txt | vllm-venv
	$(VLLM_VENV)/bin/python tests/vllm/make_models.py $(VLLM_MODELS)

test-vllm: vllm-venv $(VLLM_MODELS)/models.json
	HXFER_VLLM_MODELS=$(VLLM_MODELS) HXFER_VLLM_WORK=$(VLLM_WORK) PYTHONDONTWRITEBYTECODE=1 \
	  $(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider -rA tests/vllm $(PYTEST_ARGS)

# The bounded soak, longer: every scenario of engine_soak_test (4 in-process fault runs, 4 with
# rank kills) gets SOAK_SECONDS of faults. SOAK_SEED replays a schedule (printed at the start of
# every scenario and in every failure).
SOAK_SECONDS ?= 300
soak: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS) --target engine_soak_test
	HXFER_SOAK_SECONDS=$(SOAK_SECONDS) $(if $(SOAK_SEED),HXFER_SOAK_SEED=$(SOAK_SEED)) \
	  $(BUILD_DIR)/src/engine/engine_soak_test

demo: build
	$(BUILD_DIR)/hxfer demo

bench: build
	$(BUILD_DIR)/hxfer bench transport --backend shm --size 67108864

# libFuzzer targets (fuzz/*_fuzzer.cc), each run FUZZ_SECONDS from its seed corpus
# fuzz/corpus/<name>/ under ASan+UBSan. New inputs go to build-fuzz/corpus/, crashes to
# build-fuzz/crash-*; the checked-in corpus is only read.
FUZZ_SECONDS ?= 60
fuzz:
	@HXFER_WITH_CLANG=1 bash scripts/install-deps.sh
	@CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DHXFER_BUILD_FUZZERS=ON -DHXFER_BUILD_TESTS=OFF -DHXFER_BUILD_BENCHMARKS=OFF >/dev/null
	@cmake --build build-fuzz -j $(JOBS) --target hxfer_fuzzers
	@for src in fuzz/*_fuzzer.cc; do \
	  name=$$(basename $$src _fuzzer.cc); \
	  mkdir -p build-fuzz/corpus/$$name fuzz/corpus/$$name; \
	  echo "fuzz: $$name for $(FUZZ_SECONDS) s"; \
	  build-fuzz/fuzz/$${name}_fuzzer -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    -artifact_prefix=build-fuzz/ build-fuzz/corpus/$$name fuzz/corpus/$$name || exit 1; \
	done

format:
	@git ls-files '*.h' '*.cc' | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR)

# hxfer's named layouts against the released vLLM and SGLang code, executed (tests/engines/):
# builds its venv on first use (build/engines-venv), needs the Python module (make build).
.PHONY: test-engines
test-engines:
	bash tests/engines/run.sh --json $(BUILD_DIR)/engines-conformance.json
