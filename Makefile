# shmlink: make test is what CI runs (through .ci/run).
GO ?= go
FUZZTIME ?= 20s
BENCHCOUNT ?= 6

.PHONY: test vet lint fuzz bench example

test: vet
	$(GO) test -race -count=1 -timeout 20m ./...

vet:
	$(GO) vet ./...

lint: vet
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# Each fuzz target runs for FUZZTIME; their seed corpora run in `make test`.
fuzz:
	$(GO) test ./buffer -run '^$$' -fuzz '^FuzzRegion$$' -fuzztime $(FUZZTIME)
	$(GO) test ./queue -run '^$$' -fuzz '^FuzzRing$$' -fuzztime $(FUZZTIME)
	$(GO) test ./session -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME)
	$(GO) test ./session -run '^$$' -fuzz '^FuzzServerHandshake$$' -fuzztime $(FUZZTIME)
	$(GO) test ./session -run '^$$' -fuzz '^FuzzReceive$$' -fuzztime $(FUZZTIME)

bench:
	$(GO) test -run '^$$' -bench . -benchmem -count $(BENCHCOUNT) . | tee bench.txt

example:
	$(GO) run ./example/helloworld
