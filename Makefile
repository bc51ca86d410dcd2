# tandem - build with `make`, test with `make test` (see README).
#
# Layout: src/<family>/*.c except src/cmd/main.c, and src/backend/cpu/*.c
# (the CPU backend and its kernel sets), form libtandem.a (the families and
# what each may include: docs/architecture.md, tools/layers.sh);
# src/cmd/main.c is the `tandem` command; tests/<family>/test_*.c are test programs; fuzz/fuzz_*.c are
# libFuzzer targets (clang). BUILD selects the output folder so that the
# sanitizer build (make asan) lives beside the normal one.

CC       ?= cc
BUILD    ?= build
# plain `make` builds everything (the kernel-set rules below come first)
.DEFAULT_GOAL := all
# The build targets the compiler's baseline (plain x86-64, or armv8-a), so
# one binary runs on any CPU of the architecture. The kernel sets of
# src/backend/cpu/ are compiled with their own instruction-set flags (below)
# and quant.c picks the best one the CPU has at run time (cpuid on x86-64,
# the hwcaps on arm64 Linux). ARCH_FLAGS applies to every file (e.g.
# -march=native).
ARCH_FLAGS ?=
OPT      ?= -O2
CFLAGS   += $(SAN) -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -g $(OPT) $(ARCH_FLAGS) -pthread -Isrc
LDFLAGS  += $(SAN)
LDLIBS   += -lm -pthread -ljansson -lutf8proc -lzstd -lmicrohttpd -lcrypto -lxxhash -lcurl

# `tandem --version` names the commit it was built from (cli.c); the
# object is rebuilt by `make clean` or a change to cli.c, not by a commit.
GIT_REV  := $(shell git rev-parse --short HEAD 2>/dev/null)
ifneq ($(GIT_REV),)
$(BUILD)/obj/cmd/cli.o: CFLAGS += -DTANDEM_GIT='"$(GIT_REV)"'
endif

# PORTABLE=1: platform.c's POSIX fallbacks (what macOS gets) instead of
# Linux's own calls, so that they are tested here (`make portable`).
ifeq ($(PORTABLE),1)
CFLAGS   += -DTANDEM_PORTABLE
endif

LIB_SRC  := $(filter-out src/cmd/main.c,$(wildcard src/*/*.c)) $(wildcard src/backend/cpu/*.c)
# every header, for the objects' dependencies
HDRS     := $(wildcard src/*/*.h src/backend/*/*.h)
LIB_OBJ  := $(LIB_SRC:src/%.c=$(BUILD)/obj/%.o)

# CUDA backend (src/backend/cuda): `make CUDA=1 BUILD=build-cuda`. Needs nvcc
# and cuBLAS (CUDA 13 tested); the default build neither needs nor uses them.
# Cubins for sm_90 (H100/H200), sm_100 (B200), sm_120 (RTX Blackwell) and
# sm_121 (GB10), plus compute_90 PTX that newer GPUs JIT-compile. Override
# CUDA_ARCHS to build fewer: all five take about 35 s on 2 cores, sm_90
# alone about 8 s.
ifeq ($(CUDA),1)
CUDA_HOME  ?= /usr/local/cuda
NVCC       ?= $(CUDA_HOME)/bin/nvcc
CUDA_ARCHS ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_100,code=sm_100 \
              -gencode arch=compute_120,code=sm_120 -gencode arch=compute_121,code=sm_121 \
              -gencode arch=compute_90,code=compute_90
NVFLAGS    ?= -O2 -g -std=c++17 -Xcompiler -Wall,-Wno-unused-parameter -D_GNU_SOURCE -Isrc
CFLAGS     += -DTANDEM_CUDA
# cudart is linked statically, so the binary needs only the driver (found
# at run time, with a clear error when it is missing) and cuBLAS.
LDLIBS     += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart_static -ldl -lrt -lstdc++
CUDA_SRC   := $(wildcard src/backend/cuda/*.cu)
CUDA_OBJ   := $(CUDA_SRC:src/backend/cuda/%.cu=$(BUILD)/obj/cuda/%.o)
LIB_OBJ    += $(CUDA_OBJ)

$(BUILD)/obj/cuda/%.o: src/backend/cuda/%.cu $(HDRS) | $(BUILD)/obj
	@mkdir -p $(BUILD)/obj/cuda
	$(NVCC) $(NVFLAGS) $(CUDA_ARCHS) -c $< -o $@
endif
# MLX backend (src/backend/mlx): `tools/mlx_build.sh && make MLX=1
# BUILD=build-mlx`. C++20 against MLX's own C++ API and libmlx from
# MLX_DIR (default build/mlx, which tools/mlx_build.sh fills from the
# pinned mlx-cpu wheel; on a Mac the pip-installed mlx package's folder).
# The default build neither needs nor uses it.
ifeq ($(MLX),1)
MLX_DIR    ?= build/mlx
CXX        ?= g++
MLXFLAGS   ?= -std=c++20 -O2 -g -Wall -Wno-unused-parameter -ffp-contract=off -D_GNU_SOURCE -Isrc -I$(MLX_DIR)/include
CFLAGS     += -DTANDEM_MLX
ifeq ($(shell uname -s),Darwin)
LDLIBS     += -L$(MLX_DIR)/lib -Wl,-rpath,$(abspath $(MLX_DIR)/lib) -lmlx -lc++
else
# DT_RPATH (not RUNPATH) so that libmlx.so finds the wheel's BLAS/LAPACK beside it
LDLIBS     += -L$(MLX_DIR)/lib -Wl,--disable-new-dtags -Wl,-rpath,$(abspath $(MLX_DIR)/lib) -lmlx -lstdc++
endif
MLX_SRC    := $(wildcard src/backend/mlx/*.cpp)
MLX_OBJ    := $(MLX_SRC:src/backend/mlx/%.cpp=$(BUILD)/obj/mlx/%.o)
LIB_OBJ    += $(MLX_OBJ)

$(BUILD)/obj/mlx/%.o: src/backend/mlx/%.cpp $(HDRS) | $(BUILD)/obj
	@mkdir -p $(BUILD)/obj/mlx
	$(CXX) $(MLXFLAGS) -c $< -o $@
endif
# Per-file instruction sets of the x86-64 kernel sets (quant_kernels.h).
ifneq ($(filter x86_64-% amd64-%,$(shell $(CC) -dumpmachine)),)
# Loops start on 64-byte lines: where the code happened to fall decided the
# kernels' speed. Measured on a 2-core Zen 5, one source (commit 636cf68),
# Qwen3-0.6B Q4_K_M, 8 sequences decoding together (the 8-row K-quant walk):
# 250-259 t/s as linked, 501-506 with loops aligned, the build before it
# (whose walk fell 0x590 bytes earlier) 491-546.
KALIGN   := -falign-loops=64
KAVX2    := -mavx2 -mfma -mf16c $(KALIGN)
$(BUILD)/obj/backend/cpu/quant_avx2.o $(BUILD)/obj/backend/cpu/ops_avx2.o: CFLAGS += $(KAVX2)
$(BUILD)/obj/backend/cpu/quant_avxvnni.o: CFLAGS += $(KAVX2) -mavxvnni
$(BUILD)/obj/backend/cpu/quant_avx512.o $(BUILD)/obj/backend/cpu/ops_avx512.o: CFLAGS += $(KAVX2) -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni
endif
# arm64's dotprod and i8mm sets (quant_neon_dotprod.c, quant_neon_i8mm.c);
# quant.c uses them when the hwcaps say the CPU has the dot-product (and
# int8 matrix-multiply) instructions.
ifneq ($(filter aarch64-% arm64-%,$(shell $(CC) -dumpmachine)),)
$(BUILD)/obj/backend/cpu/quant_neon_dotprod.o: CFLAGS += -march=armv8.2-a+dotprod
$(BUILD)/obj/backend/cpu/quant_neon_i8mm.o: CFLAGS += -march=armv8.2-a+dotprod+i8mm
endif
# quant_avxvnni.c and quant_avx512.c are quant_avx2.c under other names,
# quant_neon_dotprod.c and quant_neon_i8mm.c are quant_neon.c
$(BUILD)/obj/backend/cpu/quant_avxvnni.o $(BUILD)/obj/backend/cpu/quant_avx512.o: src/backend/cpu/quant_avx2.c
$(BUILD)/obj/backend/cpu/quant_neon_dotprod.o $(BUILD)/obj/backend/cpu/quant_neon_i8mm.o: src/backend/cpu/quant_neon.c
# tests/<family>/test_*.c (the families of src/), each built as $(BUILD)/test_*
# (flat, so tests/run.sh's build/test_* finds them); tests/*.h are the shared
# helpers (-Itests); a test still at tests/test_*.c builds too.
TEST_SRC := $(wildcard tests/test_*.c tests/*/test_*.c)
TESTS    := $(patsubst %.c,$(BUILD)/%,$(notdir $(TEST_SRC)))
vpath test_%.c tests $(sort $(dir $(wildcard tests/*/test_*.c)))
FUZZERS  := $(patsubst fuzz/%.c,$(BUILD)/%,$(wildcard fuzz/fuzz_*.c))
# The fixture set (README, Correctness): $TANDEM_FIXTURES, or ../shared/fixtures.
FIX      ?= $(or $(TANDEM_FIXTURES),../shared/fixtures)
MODELS   := $(BUILD)/models/qwen3-mini-F16.gguf $(BUILD)/models/qwen3moe-mini-F16.gguf $(BUILD)/models/qwen2-mini-F16.gguf

.PHONY: all test check asan fuzz clean models portable layers
all: $(BUILD)/tandem $(TESTS)

$(BUILD)/obj/%.o: src/%.c $(HDRS) | $(BUILD)/obj
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/obj:
	mkdir -p $@

$(BUILD)/libtandem.a: $(LIB_OBJ)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/tandem: src/cmd/main.c $(BUILD)/libtandem.a
	$(CC) $(CFLAGS) $< $(BUILD)/libtandem.a $(LDFLAGS) $(LDLIBS) -o $@

$(BUILD)/test_%: test_%.c $(wildcard tests/*.h) $(BUILD)/libtandem.a
	$(CC) $(CFLAGS) -Itests $< $(BUILD)/libtandem.a $(LDFLAGS) $(LDLIBS) -o $@

# The three F16 fixture models are generated, not shipped (see the fixtures README).
# Without the fixture set (a fresh clone) there is nothing to make them from:
# `models` says so, and the tests that need them print "skipped: ...".
$(BUILD)/models/%-mini-F16.gguf: $(FIX)/tools/gen_mini.py
	mkdir -p $(BUILD)/models
	python3 $(FIX)/tools/gen_mini.py $* $@.tmp >/dev/null && mv $@.tmp $@
ifneq ($(wildcard $(FIX)/tools/gen_mini.py),)
models: $(MODELS)
else
models:
	@echo "models: fixture set $(FIX) not found (set TANDEM_FIXTURES): F16 test models not generated, the tests that need them are skipped"
endif

# tests/twohost.sh: README's two-machine recipe in two network namespaces
# (needs root; otherwise it says "skipped"). tests/peer_fit.sh: the benchmark
# helper that runs the reference peers on CPUs without their extensions, and
# the avxvnni kernel set through it on CPUs without AVX-VNNI (needs AVX-512
# VNNI; otherwise it says "skipped").
test: all models layers
	TANDEM_MODELS=$(BUILD)/models TANDEM_BIN=$(BUILD)/tandem tests/run.sh $(TESTS) tests/twohost.sh tests/peer_fit.sh

# The include rule of src/ (tools/layers.sh): a folder includes only the
# folders below it, so that lower layers never include higher ones.
layers:
	tools/layers.sh src

# The tests that go through platform.c (random bytes, the thread pool's
# waits, sockets, node processes), built with its POSIX fallbacks.
PORTABLE_TESTS := test_platform test_runtime test_sampler test_wire test_wire_attack test_handoff test_decode_node
portable: models
	$(MAKE) PORTABLE=1 BUILD=build-portable build-portable/tandem $(addprefix build-portable/,$(PORTABLE_TESTS))
	TANDEM_MODELS=$(BUILD)/models TANDEM_BIN=build-portable/tandem tests/run.sh $(addprefix build-portable/,$(PORTABLE_TESTS))
# The same suite under AddressSanitizer + UndefinedBehaviorSanitizer.
asan:
	$(MAKE) BUILD=build-asan CC=clang OPT=-O1 \
	  SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" all
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 TANDEM_ASAN=1 \
	  TANDEM_MODELS=$(BUILD)/models TANDEM_BIN=build-asan/tandem tests/run.sh $(patsubst $(BUILD)/%,build-asan/%,$(TESTS)) tests/twohost.sh

# libFuzzer targets, linked against the library sources rebuilt with clang.
fuzz: $(FUZZERS)
$(BUILD)/fuzz_%: fuzz/fuzz_%.c $(LIB_SRC) $(HDRS)
	clang -std=c11 -D_GNU_SOURCE -g -O1 $(ARCH_FLAGS) -Isrc -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
	  $< $(LIB_SRC) -lm -pthread -ljansson -lutf8proc -lzstd -lmicrohttpd -lcrypto -lxxhash -lcurl -o $@

clean:
	rm -rf build build-asan build-cuda build-portable build-mlx
