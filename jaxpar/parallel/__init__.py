"""The parallel strategies: data parallelism, ZeRO, tensor (+ sequence) parallelism, pipelines,
context and expert parallelism, compressed exchanges and relaxed synchronisation."""
