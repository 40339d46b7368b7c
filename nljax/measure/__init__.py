"""Measurement: collectives and bytes from the compiled HLO, profiler traces by model scope, FLOP
counts, host and device memory, and the figures a run writes."""
