# Entry points. `make demo` and `make test` install missing Debian packages themselves.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHXFER_BUILD_TESTS=ON -DHXFER_BUILD_BENCHMARKS=ON

.PHONY: all deps configure build test demo bench fuzz format clean

all: build

deps:
	@bash scripts/install-deps.sh

configure: deps
	@cmake -S . -B $(BUILD_DIR) -G Ninja $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 600

demo: build
	$(BUILD_DIR)/hxfer demo

bench: build
	$(BUILD_DIR)/hxfer bench transport --backend shm --size 67108864

format:
	@git ls-files '*.h' '*.cc' | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR)
