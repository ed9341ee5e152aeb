"""What a run measures about itself: throughput against the hardware, memory held per rank, router statistics,
logit parity."""
