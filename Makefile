# shmlink: make test is what CI runs (through .ci/run).
GO ?= go
FUZZTIME ?= 20s
FUZZMIN ?= 50x
BENCHCOUNT ?= 6

.PHONY: test vet lint fuzz bench example

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

bench:
	$(GO) test -run '^$$' -bench . -benchmem -count $(BENCHCOUNT) . | tee bench.txt

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
