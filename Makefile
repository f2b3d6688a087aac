# The two commands of the README. Both install what is missing first (tools/setup.sh).
#   make demo   a short multi-rank GPT training run on CPU under mpirun (NP ranks); installs and builds
#               only what it needs
#   make test   build everything and run every test (CTest)
# And: make install PREFIX=<dir>   headers, the CMake package and the tools, with no test built
BUILD_DIR ?= build
INSTALL_BUILD_DIR ?= build-install
NP ?= 2
JOBS ?= $(shell nproc)
MPIEXEC ?= mpiexec
# Open MPI refuses root and more ranks than cores unless told.
MPIEXEC_FLAGS ?= --oversubscribe $(if $(filter 0,$(shell id -u)),--allow-run-as-root)

.PHONY: all setup configure build demo test install bench format clean
all: build

setup:
	@tools/setup.sh

configure: setup
	@tools/configure.sh $(BUILD_DIR)

build: configure
	@cmake --build $(BUILD_DIR) -j$(JOBS)

# Checkpoints every 20 steps into $(BUILD_DIR)/demo_checkpoints (replaced at each demo); continue with
#   $(MPIEXEC) -n $(NP) $(BUILD_DIR)/examples/train_gpt --steps 60 --save-every 20 --ckpt-dir $(BUILD_DIR)/demo_checkpoints --resume
demo:
	@tools/setup.sh --demo
	@tools/configure.sh $(BUILD_DIR)
	@cmake --build $(BUILD_DIR) -j$(JOBS) --target train_gpt
	OMP_NUM_THREADS=1 $(MPIEXEC) -n $(NP) $(MPIEXEC_FLAGS) $(BUILD_DIR)/examples/train_gpt --steps 40 \
		--save-every 20 --ckpt-dir $(BUILD_DIR)/demo_checkpoints --overwrite

test: build
	@cd $(BUILD_DIR) && ctest --output-on-failure -j$(JOBS)

# What a user of the library needs, without the tests, examples or benchmarks: configured in a build
# folder of its own (INSTALL_BUILD_DIR), so build/ keeps its tests.
install: setup
	@test -n "$(PREFIX)" || { echo "make install: say where, e.g. make install PREFIX=$$HOME/fsdpx"; exit 2; }
	@tools/configure.sh $(INSTALL_BUILD_DIR) -DFSDPX_BUILD_TESTS=OFF -DFSDPX_BUILD_EXAMPLES=OFF \
		-DFSDPX_BUILD_BENCHMARKS=OFF
	@cmake --build $(INSTALL_BUILD_DIR) -j$(JOBS)
	@cmake --install $(INSTALL_BUILD_DIR) --prefix $(PREFIX)

# The benchmarks are built on demand (not by `make build`); each benchmarks/run_*.sh builds its own.
bench: build
	@cmake --build $(BUILD_DIR) -j$(JOBS) --target bench_collectives
	OMP_NUM_THREADS=1 $(MPIEXEC) -n $(NP) $(MPIEXEC_FLAGS) $(BUILD_DIR)/benchmarks/bench_collectives

# Lays out every C++ file as .clang-format says (the `format` test checks it).
format: setup
	@tools/check_format.sh --fix

clean:
	rm -rf $(BUILD_DIR) $(INSTALL_BUILD_DIR)
