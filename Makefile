# shmlink: make test is what CI runs (through .ci/run).
GO ?= go
FUZZTIME ?= 20s
FUZZMIN ?= 50x
BENCHCOUNT ?= 6

.PHONY: test vet lint fuzz bench example arm64

test: vet
	$(GO) test -race -count=1 -timeout 20m ./...
	cd example/grpc && $(GO) vet ./... && $(GO) test -race -count=1 -timeout 5m ./...

vet:
	$(GO) vet ./...

lint: vet
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# Each fuzz target runs for FUZZTIME; their seed corpora run in `make test`.
# FUZZMIN bounds the minimization of each new input by executions: the
# handshake target waits out a 200 ms timeout on many inputs, and the default
# 60 s of minimization per input would eat the whole budget.
fuzz:
	$(GO) test ./buffer -run '^$$' -fuzz '^FuzzRegion$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMIN)
	$(GO) test ./buffer -run '^$$' -fuzz '^FuzzAttach$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMIN)
	$(GO) test ./queue -run '^$$' -fuzz '^FuzzRing$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMIN)
	$(GO) test ./internal/wire -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMIN)
	$(GO) test ./session -run '^$$' -fuzz '^FuzzServerHandshake$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMIN)
	$(GO) test ./session -run '^$$' -fuzz '^FuzzReceive$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMIN)

# The root module's benchmarks, then BenchmarkGRPC and BenchmarkInProcessGRPC,
# which live in the gRPC example's module so that the main module does not
# depend on gRPC. They run in BENCHCOUNT rounds of one run each, not with
# -count, so that in every round each case's transports run seconds apart,
# within the same phase of a shared host. bench.md gets the README's tables
# (internal/benchtab): medians of the rounds.
bench:
	rm -f bench.txt
	$(GO) test -c -o bench-root.test .
	cd example/grpc && $(GO) test -c -o ../../bench-grpc.test .
	for r in $$(seq $(BENCHCOUNT)); do \
		./bench-root.test -test.run '^$$' -test.bench . -test.benchmem | tee -a bench.txt; \
		(cd example/grpc && ../../bench-grpc.test -test.run '^$$' -test.bench 'BenchmarkGRPC|BenchmarkInProcessGRPC' -test.benchmem) | tee -a bench.txt; \
	done
	rm -f bench-root.test bench-grpc.test
	$(GO) run ./internal/benchtab bench.txt > bench.md

example:
	$(GO) run ./example/helloworld

# Interop with the Rust shmipc crate (interop/): the tests build interop/rust
# with cargo into interop/rust/target, then run both directions. Needs cargo.
.PHONY: interop
interop:
	@command -v cargo >/dev/null || { echo "make interop: cargo not found in PATH (install Rust with rustup)" >&2; exit 1; }
	$(GO) vet -tags interop ./interop/...
	$(GO) test -race -tags interop -count=1 -timeout 15m -v ./interop/...

# The randomized soak test (soak_test.go, TestSoak) for SOAKTIME, all its
# variants together, under the race detector; `make test` runs it for a few
# seconds. Every run logs its seed: SHMLINK_SOAK_SEED=<seed> repeats its
# session settings and stream plans. Raise SOAKTIMEOUT with SOAKTIME.
SOAKTIME ?= 2m
SOAKTIMEOUT ?= 1h
.PHONY: soak
soak:
	SHMLINK_SOAK=$(SOAKTIME) $(GO) test -race -count=1 -run '^TestSoak$$' -timeout $(SOAKTIMEOUT) -v .

# buffer/, queue/ and session/ built for arm64 and run under qemu-user
# (Debian's qemu-user-static); their child processes run through it too
# (SHMLINK_TEST_EMULATOR). qemu-user has no NETLINK_SOCK_DIAG, which the
# TCP peer-uid check needs (docs/protocol.md section 9), so the session
# tests over TCP are left to the native run: ARM64_SKIP.
QEMU ?= qemu-aarch64-static
ARM64_SKIP ?= ^(TestV2HijackRefused|TestTCPPeerOfAnotherUIDRefused|TestClientHandshakeNoAnswer)$$
arm64:
	@command -v $(QEMU) >/dev/null || { echo "make arm64: $(QEMU) not found (Debian package qemu-user-static)" >&2; exit 1; }
	@mkdir -p .arm64
	set -e; for p in buffer queue session; do \
		GOARCH=arm64 $(GO) test -c -o .arm64/$$p.test ./$$p; \
		(cd $$p && SHMLINK_TEST_EMULATOR=$(QEMU) $(QEMU) ../.arm64/$$p.test -test.count=1 -test.timeout=10m -test.skip '$(ARM64_SKIP)'); \
	done
